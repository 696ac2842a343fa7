"""FlashAdamW in four trainers, each with a checkpoint saved mid-run and resumed by fresh
objects (docs/flashoptim.md, "Trainers"; tests: tests/test_trainers.py, which checks that
every resumed run ends bit for bit where the uninterrupted one ends).

    python examples/trainers.py DIR [hf|hf_cls|lightning|accelerate|torchtitan ...]

Each recipe builds a bf16 model (no fp32 copy: the 8-bit corrections keep the rest of the
master weights) and trains it on CPU or wherever its trainer puts it. What the trainer
saves is ``opt.state_dict()`` (codes, scales, corrections, steps, seeds: about 3.1
bytes/param for AdamW) and what it loads goes through ``opt.load_state_dict``; nothing
else is needed. Each function returns the final weights, the optimizer and the step
count it reached.
"""

from __future__ import annotations

import os
import sys

import torch

import flashoptim_fused as fo

LR = 1e-2


class Regressor(torch.nn.Module):
    """A tiny model in the calling conventions of every trainer below."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def forward(self, x, labels=None):
        out = self.net(x).squeeze(-1).float()
        if labels is None:
            return out
        return {"loss": torch.nn.functional.mse_loss(out, labels.float()), "logits": out}


def dataset(n: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(n, 32, generator=g), torch.randn(n, generator=g)
    return [{"x": x.bfloat16(), "labels": y} for x, y in zip(xs, ys)]


def weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------- Hugging Face Trainer
def hf_trainer(out: str, steps: int = 6, save_every: int = 3, resume=None, cls=False):
    """``transformers.Trainer`` with FlashAdamW, passed as an object
    (``optimizers=(opt, None)``) or built by the Trainer (``optimizer_cls_and_kwargs``;
    it puts the biases and norms in a group without weight decay). The Trainer saves
    ``opt.state_dict()`` into each ``checkpoint-N`` folder and loads it on
    ``train(resume_from_checkpoint=...)``."""
    from transformers import Trainer, TrainingArguments

    model = Regressor().bfloat16()
    args = TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=LR,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=save_every,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        logging_strategy="no",
    )
    if cls:
        kw = dict(optimizer_cls_and_kwargs=(fo.FlashAdamW, {"lr": LR, "weight_decay": 0.1}))
    else:
        opt = fo.FlashAdamW(model.parameters(), lr=LR, weight_decay=0.1)
        kw = dict(optimizers=(opt, None))
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), **kw)
    trainer.train(resume_from_checkpoint=resume)
    return weights(model), trainer.optimizer, trainer.state.global_step


# ------------------------------------------------------------------------------ Lightning
def lightning(out: str, epochs: int = 2, resume=None):
    """A ``LightningModule`` whose ``configure_optimizers`` returns FlashAdamW;
    ``precision="bf16-true"`` casts the module to bf16 before the optimizer is built. A
    checkpoint after every epoch (``ModelCheckpoint``) holds ``opt.state_dict()``;
    ``fit(ckpt_path=...)`` resumes it."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Regressor()

        def training_step(self, batch, _):
            return self.model(batch["x"], batch["labels"])["loss"]

        def configure_optimizers(self):
            return fo.FlashAdamW(self.parameters(), lr=LR, weight_decay=0.1)

    module = Module()
    loader = torch.utils.data.DataLoader(dataset(24), batch_size=8)  # 3 steps per epoch
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        max_epochs=epochs,
        precision="bf16-true",
        accelerator="auto",
        devices=1,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, ckpt_path=resume)
    return weights(module.model), trainer.optimizers[0], trainer.global_step


# ----------------------------------------------------------------------------- Accelerate
def accelerate(out: str, steps: int = 6, save_at: int = 3, resume: bool = False):
    """``accelerator.prepare`` wraps FlashAdamW (``AcceleratedOptimizer``);
    ``save_state`` writes ``opt.state_dict()`` next to the model and RNG states,
    ``load_state`` puts it back into a fresh optimizer."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=not torch.cuda.is_available())
    model = Regressor().bfloat16()
    opt = fo.FlashAdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(dataset(8 * steps), batch_size=8)
    model, opt, loader = acc.prepare(model, opt, loader)
    first = 0
    if resume:
        acc.load_state(out)
        loader = acc.skip_first_batches(loader, save_at)
        first = save_at
    for step, batch in enumerate(loader, start=first):
        loss = model(batch["x"], batch["labels"])["loss"]
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step + 1 == save_at and not resume:
            acc.save_state(out)
    return weights(acc.unwrap_model(model)), opt.optimizer, steps


# ----------------------------------------------------------------------------- torchtitan
def torchtitan_container():
    """torchtitan's optimizer builder with FlashAdamW: ``OptimizersContainer`` resolves
    ``ParamGroupConfig.optimizer_name`` in ``_resolve_optimizer_factory``; a subclass adds
    ours. Its checkpoints (``state_dict`` / ``load_state_dict``, flat FQN-keyed dicts that
    torch.distributed.checkpoint saves and reshards) read the state names from the live
    optimizer state, which are the names ``opt.state_dict()`` saves."""
    from torchtitan.components.optimizer import OptimizersContainer

    class FlashOptimizersContainer(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name):
            flash = {"FlashAdamW": fo.FlashAdamW, "FlashLion": fo.FlashLion}
            if name in flash:
                return flash[name]
            return OptimizersContainer._resolve_optimizer_factory(name)

    return FlashOptimizersContainer


def torchtitan(out: str, steps: int = 6, save_at: int = 3, resume: bool = False):
    """A model part stepped by ``FlashOptimizersContainer`` (biases without weight decay);
    the container saved and loaded by torch.distributed.checkpoint, as torchtitan's
    ``CheckpointManager`` does (one process here: no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.optimizer import ParamGroupConfig

    container_cls = torchtitan_container()
    model = Regressor().bfloat16()
    config = container_cls.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r"\.bias$",
                optimizer_name="FlashAdamW",
                optimizer_kwargs={"lr": LR, "weight_decay": 0.0},
            ),
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="FlashAdamW",
                optimizer_kwargs={"lr": LR, "weight_decay": 0.1},
            ),
        ],
        implementation="for-loop",
    )
    opts = container_cls(config, model_parts=[model])
    data = dataset(8 * steps)
    first = 0
    if resume:
        state = {"model": model.state_dict(), "optimizer": opts}
        dcp.load(state, checkpoint_id=out)
        model.load_state_dict(state["model"])
        first = save_at
    for step in range(first, steps):
        batch = data[8 * step : 8 * step + 8]
        x = torch.stack([b["x"] for b in batch])
        y = torch.stack([b["labels"] for b in batch])
        model(x, y)["loss"].backward()
        opts.step()
        opts.zero_grad()
        if step + 1 == save_at and not resume:
            dcp.save({"model": model.state_dict(), "optimizer": opts}, checkpoint_id=out)
    return weights(model), opts.optimizers[0], steps


RECIPES = {
    "hf": hf_trainer,
    "hf_cls": lambda out, **kw: hf_trainer(out, cls=True, **kw),
    "lightning": lightning,
    "accelerate": accelerate,
    "torchtitan": torchtitan,
}

if __name__ == "__main__":
    root = sys.argv[1]
    for name in sys.argv[2:] or list(RECIPES):
        _, opt, steps = RECIPES[name](os.path.join(root, name))
        print(f"{name}: {steps} steps, {type(opt).__name__}")

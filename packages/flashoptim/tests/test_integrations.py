"""Hugging Face ``Trainer`` with ``optimizers=(FlashAdamW(...), None)`` and Lightning's
``configure_optimizers`` returning a FlashAdamW: a few training steps on CUDA move the
weights, every step is counted and none skipped, the checkpoint state dict round-trips.
transformers and lightning are not in CI's environment (skipped there); the GPU host has
them (``gpu`` tests: ``tools/gpu_run.sh``)."""

import tempfile

import pytest
import torch

import flashoptim_fused as fo


class _Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        )

    def forward(self, x, labels=None):
        out = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _moved_and_counted(opt, before, steps):
    ps = [p for g in opt.param_groups for p in g["params"]]
    assert any(not torch.equal(a, p.detach().cpu()) for a, p in zip(before, ps))
    assert all(opt.state[p]["step"] == steps for p in ps)
    assert opt.skipped_steps == 0
    fresh = fo.FlashAdamW([p.detach().clone().requires_grad_() for p in ps])
    fresh.load_state_dict(opt.state_dict())


@pytest.mark.gpu
def test_gpu_hugging_face_trainer():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _Regressor()
    before = [p.detach().clone() for p in model.parameters()]
    data = [{"x": torch.randn(8), "labels": torch.randn(())} for _ in range(32)]
    opt = fo.FlashAdamW(model.parameters(), lr=1e-2)  # states are created on the first step
    with tempfile.TemporaryDirectory() as d:
        args = transformers.TrainingArguments(
            d, max_steps=5, per_device_train_batch_size=4, report_to=[], save_strategy="no"
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, optimizers=(opt, None)
        )
        trainer.train()
    _moved_and_counted(opt, before, 5)


@pytest.mark.gpu
def test_gpu_lightning_configure_optimizers():
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _Regressor()
            self.opt = None

        def training_step(self, batch, _):
            x, y = batch
            return self.model(x, y)["loss"]

        def configure_optimizers(self):
            self.opt = fo.FlashAdamW(self.parameters(), lr=1e-2)
            return self.opt

    torch.manual_seed(0)
    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    xs, ys = torch.randn(32, 8), torch.randn(32)
    loader = torch.utils.data.DataLoader(list(zip(xs, ys)), batch_size=4)
    trainer = L.Trainer(
        max_steps=5,
        accelerator="gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, loader)
    _moved_and_counted(module.opt, before, 5)

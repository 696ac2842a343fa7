"""The first training steps of the parity GPT under several optimizer set-ups (CPU is enough).

    python packages/flashoptim/scripts/early_steps.py --steps 6 --schedule 400

Same model, init (seed 1), data order and LR schedule as ``python -m flashoptim.parity
--steps 400`` (the corpus is this machine's standard library, so the numbers differ from the
GPU host's), 64 x 256 bytes per step. Prints the loss of each step for:

- ``torch_adamw``: fp32 weights and compute, torch AdamW;
- ``torch_adamw_bf16_compute``: fp32 master weights, every weight cast to bf16 for the
  forward and backward (what FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` does);
- ``flash_adamw``: bf16 weights with the fp32 init kept as master (``load_master_weights``);
- ``flash_adamw_bf16_init`` and its ``_fp32_states`` / ``_bits32`` variants: the model cast
  to bf16 with zero corrections, as before ``load_master_weights``.

NOTES.md ("Parity at 400 steps") has the numbers this printed.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

import flashoptim as fo
from flashoptim.parity import GPT, load_corpus, lr_schedule

SETUPS = {
    "torch_adamw": None,
    "torch_adamw_bf16_compute": None,
    "flash_adamw": {},
    "flash_adamw_bf16_init": {},
    "flash_adamw_bf16_init_fp32_states": {"quantize": False},
    "flash_adamw_bf16_init_bits32": {"master_weight_bits": 32},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--schedule", type=int, default=400, help="length of the LR schedule")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--setups", default=",".join(SETUPS))
    a = ap.parse_args()
    corpus = load_corpus(24_000_000)
    train = corpus[: int(corpus.numel() * 0.95)]
    g = torch.Generator().manual_seed(1000 + a.seed)  # the parity run's data order
    batches = []
    for _ in range(a.steps):
        ix = torch.randint(0, train.numel() - 257, (64,), generator=g)
        batches.append(torch.stack([train[i : i + 257] for i in ix]))
    for name in a.setups.split(","):
        torch.manual_seed(a.seed)
        model = GPT(512, 8, 8, 256)
        hp = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
        if name.startswith("flash"):
            masters = [p.detach().clone() for p in model.parameters()]
            model = model.to(torch.bfloat16)
            opt = fo.FlashAdamW(model.parameters(), backend="torch", **hp, **SETUPS[name])
            if "bf16_init" not in name:
                opt.load_master_weights(masters)
        else:
            opt = torch.optim.AdamW(model.parameters(), **hp)
        sched = lr_schedule(opt, a.schedule)
        losses, t0 = [], time.time()
        for xb in batches:
            if name == "torch_adamw_bf16_compute":
                params = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
                logits = functional_call(model, params, (xb[:, :-1],))
            else:
                logits = model(xb[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, 256), xb[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
        print(f"{name:36s} {losses} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

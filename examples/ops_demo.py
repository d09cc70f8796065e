"""A small real demonstration of verl's fused kernels: advantage whitening over a response mask.

Builds a PPO-sized batch (B responses x T tokens, right-padded), whitens it with the fused
`verl.ops.masked_whiten` and with its pure-PyTorch reference, checks they agree, and times both.

    python examples/ops_demo.py [--batch 256] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import time

import torch

import verl.ops as O
from verl import _extension


def _time(fn, repeat: int = 10) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(args.batch, args.tokens, generator=g) * 2.0 + 0.5
    lengths = torch.randint(1, args.tokens + 1, (args.batch,), generator=g)
    mask = torch.arange(args.tokens)[None, :] < lengths[:, None]
    fused = O.masked_whiten(adv, mask)
    ref = O.masked_whiten_ref(adv.double(), mask).float()
    err = (fused - ref).abs().max().item()
    print(f"batch {args.batch} x {args.tokens}, {int(mask.sum())} valid tokens; verl._C built: {_extension.available()}")
    print(f"whitened mean {O.masked_mean(fused, mask).item():+.2e}, var {O.masked_var(fused, mask).item():.6f}; "
          f"max |fused - reference| = {err:.2e}")
    t_fused = _time(lambda: O.masked_whiten(adv, mask))
    with O.backend("reference"):
        t_ref = _time(lambda: O.masked_whiten(adv, mask))
    print(f"masked_whiten: fused {t_fused * 1e3:.2f} ms, PyTorch eager reference {t_ref * 1e3:.2f} ms "
          f"({t_ref / t_fused:.1f}x)")
    assert err < 1e-4, "fused kernel and reference disagree"


if __name__ == "__main__":
    main()

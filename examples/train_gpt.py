"""Train a GPT-style model with tiermem's offloading, configured by YAML + dotted overrides.

    python examples/train_gpt.py                                   # CPU default (configs/cpu.yaml)
    python examples/train_gpt.py --config examples/configs/h200_1b.yaml
    python examples/train_gpt.py optimizer.offload_fraction=1.0 activations.num_layers=2 \\
        optimizer.state_tier=nvme store.nvme_bytes=1GiB store.nvme_dir=/tmp/spill

The config has five sections (every field: docs/configuration.md): ``model`` (GPT shape),
``train`` (the loop: steps, batch, dtype, device, baseline comparison), ``store`` (the
:class:`tiermem.StoreConfig` both offloaders share), ``optimizer`` (:class:`tiermem.optim.HybridAdam`)
and ``activations`` (:func:`tiermem.offload.offload_activations`). Overrides are
``section.field=value`` with YAML values; an unknown section or field is an error naming the
valid ones.

The run: a GPT (``tiermem.models.gpt.GPT``) learns a generated Markov-chain token stream
(:class:`tiermem.apps.demo.MarkovText`; nothing is downloaded), with a tqdm bar and a line per step
(loss, tokens/s, bytes per store tier after the forward pass). With ``train.baseline: true`` the
same model is then trained from the same initial weights on the same batches with plain
``torch.optim.AdamW(fused=True)`` and no activation offload, and the two are compared: max loss
difference, optimizer state and activations per place, and peak GPU memory (CUDA) or the
device-tier footprint and process RSS (CPU). The loop itself is :func:`tiermem.apps.demo.train`
(one function, ~80 lines: store, HybridAdam, ``with offloader: loss = model(...)``, backward,
step); copy it into your own trainer.

A ``store.nvme_dir`` that does not exist is created (mode 0700) when the run uses the nvme tier.

Exit code: 0 the run finished (and matched the baseline within ``train.tolerance``), 1 the
losses differ by more than the tolerance, 2 bad config (one line on stderr naming the field or
file and the fix).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from tiermem._files import CONFIG_ERRORS, config_error, make_private_dir
from tiermem.apps.demo import RunConfig, run

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "cpu.yaml")


def preset_path(name: str) -> str:
    """Path of ``examples/configs/NAME.yaml``.

    Raises:
        FileNotFoundError: no such preset (the message lists the available ones).
    """
    path = os.path.join(HERE, "configs", f"{name}.yaml")
    if not os.path.exists(path):
        names = sorted(f[:-5] for f in os.listdir(os.path.join(HERE, "configs"))
                       if f.endswith(".yaml"))
        raise FileNotFoundError(f"no preset {name!r}; available: {', '.join(names)}")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", metavar="SECTION.FIELD=VALUE",
                   help="dotted overrides, e.g. optimizer.offload_fraction=0.5 "
                        "activations.num_layers=8 store.nvme_dir=/tmp/spill")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", default=None, metavar="YAML",
                       help=f"config file (default {os.path.relpath(DEFAULT_CONFIG)})")
    where.add_argument("--preset", default=None, metavar="NAME",
                       help="a file of examples/configs/ by name: cpu, h200_1b, h200_7b, ...")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, train, compare; return the exit code (0 ok, 1 mismatch, 2 usage)."""
    args = build_parser().parse_args(argv)
    path = None
    try:
        path = preset_path(args.preset) if args.preset else (args.config or DEFAULT_CONFIG)
        cfg = RunConfig.load(path, args.overrides)
    except (ValueError, TypeError) as exc:
        print(f"train_gpt: error: {exc}", file=sys.stderr)
        return 2
    except CONFIG_ERRORS as exc:  # a directory, a missing or unreadable file, broken YAML
        message = str(exc) if path is None else config_error(
            "--preset" if args.preset else "--config", path, exc)
        print(f"train_gpt: error: {message}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(cfg.to_tree(), sort_keys=False), end="")
        return 0
    print(f"config: {path}" + (f" + {' '.join(args.overrides)}" if args.overrides else ""))
    try:
        if cfg.store.nvme_bytes and cfg.store.nvme_dir is not None:
            make_private_dir(cfg.store.nvme_dir, "store.nvme_dir", log=print)
        _, _, cmp = run(cfg)
    except ValueError as exc:  # a combination only the library can judge (e.g. budgets)
        print(f"train_gpt: error: {exc}", file=sys.stderr)
        return 2
    return 0 if cmp is None or cmp.ok else 1


if __name__ == "__main__":
    sys.exit(main())

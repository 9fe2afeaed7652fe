"""``python -m workers.blender --cmd-fd N --reply-fd M [--device cpu|gpu] [--gpu-backend X]
[--threads N]``: the Blender child the render worker starts (workers/child.py)."""

from __future__ import annotations

import argparse
import sys
import time

from workers.blender import process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workers.blender")
    parser.add_argument("--cmd-fd", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--gpu-backend", default=None)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    process.prepare(args.cmd_fd, args.reply_fd)
    t0 = time.perf_counter()
    from workers.blender import session  # imports bpy: only now, with the death signal armed

    return session.run(
        args.device, args.gpu_backend, args.threads, args.cmd_fd, args.reply_fd,
        import_s=time.perf_counter() - t0,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

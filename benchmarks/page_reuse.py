"""First-write cost of a fresh 256 MiB CPU buffer: small pages or transparent huge pages, the
memory reused at once or after an idle pause.

On a VM whose balloon device reports free pages to the host (virtio feature bit 5,
``VIRTIO_BALLOON_F_REPORTING``), free 2 MiB blocks are handed back to the host about two
seconds after they are freed, and the next fault on them is served by the host again. Huge
pages are then cheap when a buffer's memory comes back within the pause and expensive after
it; a step that takes about two seconds alternates between the two. This script shows which
kind of machine it runs on:

    python benchmarks/page_reuse.py            # pauses 0.1 s and 3 s, 4 buffers each
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time
from pathlib import Path

import torch

from tile_pass.tiles import _tile_buffers

MIB = 1 << 20


def free_page_reporting() -> str:
    """Whether a virtio balloon device here offers free page reporting, as far as sysfs says."""
    for device in glob.glob("/sys/bus/virtio/devices/*"):
        try:
            if Path(device, "device").read_text().strip() != "0x0005":  # the balloon
                continue
            features = Path(device, "features").read_text().strip()
        except OSError:
            continue
        return "on" if len(features) > 5 and features[5] == "1" else "off"
    return "no balloon device"


def first_write_ms(huge: bool, nbytes: int) -> float:
    buffer = _tile_buffers.empty((nbytes,), torch.uint8, torch.device("cpu")) if huge else torch.empty(
        nbytes, dtype=torch.uint8
    )  # fmt: skip
    start = time.perf_counter()
    buffer.fill_(1)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--pauses", default="0.1,3")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    print(f"free page reporting: {free_page_reporting()}; buffer {args.mib} MiB; median of {args.repeats}")
    print("| pages | pause s | first write ms (each) | median |")
    print("|---|---|---|---|")
    for pause in (float(p) for p in args.pauses.split(",")):
        for huge in (False, True):
            times = []
            for _ in range(args.repeats):
                times.append(first_write_ms(huge, args.mib * MIB))
                time.sleep(pause)
            each = ", ".join(f"{t:.0f}" for t in times)
            pages = "huge (madvise)" if huge else "4 KiB"
            print(f"| {pages} | {pause:g} | {each} | {statistics.median(times):.0f} |")


if __name__ == "__main__":
    main()

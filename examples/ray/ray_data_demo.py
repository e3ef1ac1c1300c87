"""The demo job as a Ray Data stage: read the demo prompts, add completions, write Parquet.

    python examples/ray/ray_data_demo.py                       # local Ray, CPU
    python examples/ray/ray_data_demo.py --actors 4 --gpus 1   # 4 actors with a GPU each

Every actor builds the job's engine once (target, drafters, bandit) and decodes batches of
rows through it; see spin_batch/ray_data.py. On a cluster, start it with `ray job submit`
or after `ray.init(address="auto")`, and point --input / --out at shared storage.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import time

import spin_batch.ray_data as srd  # first: see spin_batch/__init__.py (the kernels/ name clash)

import ray


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="jobs/demo.yaml")
    ap.add_argument("--input", default="examples/prompts/*.jsonl", help="JSONL files (a glob)")
    ap.add_argument("--out", default="out/ray-demo")
    ap.add_argument("--actors", type=int, default=1, help="engines running at once")
    ap.add_argument("--gpus", type=float, default=None, help="GPUs per actor (CPU actors when left out)")
    ap.add_argument("--cpus", type=float, default=1, help="CPUs per actor in Ray's accounting (leave some "
                    "for Ray's read and write tasks)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OpenMP threads per actor")
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a job key, as `spin-batch run --set` does")
    ap.add_argument("--overwrite", action="store_true", help="replace what --out already holds")
    args = ap.parse_args()
    if os.path.isdir(args.out) and os.listdir(args.out):
        # Ray's write_parquet adds files next to the old ones, so a rerun would hold every row twice
        if not args.overwrite:
            ap.error(f"{args.out} is not empty; pass --overwrite to replace it, or another --out")
        shutil.rmtree(args.out)

    ray.init()
    ds = ray.data.read_json(sorted(glob.glob(args.input)), lines=True)
    if args.limit is not None:
        ds = ds.limit(args.limit)
    t0 = time.perf_counter()
    out = srd.generate(ds, args.job, args.overrides, concurrency=args.actors, num_gpus=args.gpus,
                       num_cpus=args.cpus, threads=args.threads)
    out.write_parquet(args.out)
    rows = ray.data.read_parquet(args.out)
    stats = rows.groupby("status").count().take_all()
    tokens = rows.sum("completion_tokens")
    print(f"{args.out}: {stats}; {tokens} tokens in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""How many cores one simulated host device's work gets, alone and inside a 4-device program.

    python -m tools.probe_spmd_threads [--tiny] [--repeat 3] [--json PATH]

The same elementwise work (``tanh``/``exp`` over a float32 array, 128 MB by default), run three ways,
each in a fresh process:

- ``jit``: ``jax.jit`` on one device;
- ``one_device_mesh``: in a ``shard_map`` over a mesh of one device, under ``lax.cond`` (always taken);
- ``four_device_mesh``: in a ``shard_map`` over 4 host devices
  (``--xla_force_host_platform_device_count=4``), where only device 0 takes the ``lax.cond``: the others
  pass their block through, as the devices that are not working do in the adjoint pass's sharded
  region (``passes/adjoint/sharded.py``, ``_stages``).

For each: wall seconds of the best of ``--repeat`` calls and the process's user CPU seconds over those
calls divided by their wall seconds (the cores used). On the 2-core CI machine with jaxlib 0.10.2,
``jit`` and ``one_device_mesh`` used about 1.5 cores and ``four_device_mesh`` one core, taking about twice
as long for the same work: XLA:CPU runs each device of a multi-device program on one thread. This is
why the adjoint pass's sharded region, whose devices take turns, cannot match one device's time on
this machine (docs/passes/adjoint.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = ("jit", "one_device_mesh", "four_device_mesh")
RESULT = "PROBE_RESULT "


def child(mode: str, elements: int, repeat: int) -> dict:
    """Run ``mode`` in this process (its device count set by the parent) and return its figures."""
    import resource
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def work(x):
        for _ in range(6):
            x = jnp.tanh(x * 1.001 + 0.5) * jnp.exp(-x * x)
        return x

    rows = elements // 4096
    if mode == "jit":
        fn, x = jax.jit(work), jnp.ones((rows, 4096), jnp.float32)
    else:
        n = jax.device_count()
        mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

        def body(block):
            return jax.lax.cond(jax.lax.axis_index("x") == 0, work, lambda v: v, block)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        x = jax.device_put(jnp.ones((rows * n, 4096), jnp.float32), NamedSharding(mesh, P("x")))
    fn(x).block_until_ready()
    walls, before, start = [], resource.getrusage(resource.RUSAGE_SELF).ru_utime, time.perf_counter()
    for _ in range(repeat):
        t = time.perf_counter()
        fn(x).block_until_ready()
        walls.append(time.perf_counter() - t)
    user = resource.getrusage(resource.RUSAGE_SELF).ru_utime - before
    return {"mode": mode, "devices": jax.device_count(), "best_s": min(walls),
            "cores_used": user / (time.perf_counter() - start), "elements": elements}


def run(mode: str, elements: int, repeat: int) -> dict:
    """``mode`` in a fresh process (4 host devices for ``four_device_mesh``)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if mode == "four_device_mesh":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    done = subprocess.run([sys.executable, "-m", "tools.probe_spmd_threads", "--child", mode,
                           "--elements", str(elements), "--repeat", str(repeat)],
                          capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return {"mode": mode, "status": "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a small array, one call: a smoke run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--elements", type=int, default=32 * 2**20)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.elements, args.repeat = 4096 * 64, 1
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.elements, args.repeat)), flush=True)
        return 0
    rows = [run(mode, args.elements, args.repeat) for mode in MODES]
    base = rows[0].get("best_s")
    for row in rows:
        if "best_s" in row:
            ratio = f"  {row['best_s'] / base:4.2f}x jit's" if base else ""
            print(f"{row['mode']:18s} {row['devices']} device(s)  best {row['best_s']:.3f} s  "
                  f"{row['cores_used']:.2f} cores{ratio}")
        else:
            print(f"{row['mode']:18s} {row['status']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"what": "python -m tools.probe_spmd_threads", "rows": rows}, out, indent=1)
    return 0 if all("best_s" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

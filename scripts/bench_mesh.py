"""Host time per serving step on a tensor-parallel mesh of 1, 2, 4 and 8 devices, in one run.

The same model, plan and prompts are served on meshes of each ``--devices`` count
(:mod:`jaxkv.device.mesh`). A step's wall time splits into jaxkv's host time
(scheduling, the KV cache manager, building and placing the step metadata), JAX's call of
the jitted step (:attr:`~jaxkv.serving.runner.ModelRunner.dispatch_s`: argument handling
and dispatch to every device) and the wait for the device's tokens
(:attr:`~jaxkv.serving.runner.ModelRunner.device_wait_s`). jaxkv's part does not depend
on the device count, so neither should its time; JAX's call grows with the buffers it
hands to devices (weights and cache leaves x devices) and, with host devices sharing a
few cores, with partitions of the step it runs before returning. The table gives both
with each count's ratio to the first (the baseline, 1 device). Every engine is warmed
up on the same prompts first (the timed run compiles nothing, checked), and the tokens
must be identical on every mesh (exit 1 otherwise). On CPU the devices are host devices
the script asks XLA for before JAX starts.

    python scripts/bench_mesh.py --out bench_mesh.json
    python scripts/bench_mesh.py --model tiny-hybrid-kv8 --devices 1,2,4,8

Bad input prints one line ``bench_mesh.py: error: ...`` on stderr and exits with status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from jaxkv.commands.cli import request_cpu_devices

DEFAULT_DEVICES = ["1", "2", "4", "8"]
request_cpu_devices([f"--cpu_devices={DEFAULT_DEVICES[-1]}"], flag="cpu_devices")  # 8 host devices, before JAX starts

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxkv.commands.cli import exit_error, flags_parser  # noqa: E402
from jaxkv.device.mesh import model_mesh  # noqa: E402
from jaxkv.errors import JaxkvError  # noqa: E402
from jaxkv.models.tiny import model_names  # noqa: E402
from jaxkv.serving.engine import Engine  # noqa: E402
from jaxkv.serving.workloads import shared_prefix_prompts  # noqa: E402

PROG = "bench_mesh.py"
FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "tiny-llama-kv8", list(model_names()), "model architecture (KV heads split over devices)")
flags.DEFINE_list("devices", DEFAULT_DEVICES, "mesh sizes to compare; the first is the baseline")
flags.DEFINE_integer("num_requests", 16, "requests in the batch", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 32, "tokens generated per request", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "timed runs per mesh (the best is kept)", lower_bound=1)
flags.DEFINE_string("out", None, "write the results as JSON to this path")


def measure(num_devices: int, prompts: list[list[int]]) -> dict:
    """Serve ``prompts`` on a mesh of ``num_devices`` (warmed up): host ms per step (best run), tokens."""
    engine = Engine.build(
        FLAGS.model, memory_bytes=16 << 20, max_model_len=512, mesh=model_mesh(num_devices), enable_caching=False
    )
    engine.generate(prompts, FLAGS.max_new_tokens)
    best = None
    runner = engine.runner
    for _ in range(FLAGS.repeats):
        waited, dispatched = runner.device_wait_s, runner.dispatch_s
        result = engine.generate(prompts, FLAGS.max_new_tokens)
        dispatch_s = (runner.dispatch_s - dispatched) / result.num_steps
        host_s = (result.wall_s - (runner.device_wait_s - waited)) / result.num_steps - dispatch_s
        if best is None or host_s < best["host_ms_per_step"] / 1e3:
            best = {
                "host_ms_per_step": host_s * 1e3,
                "dispatch_ms_per_step": dispatch_s * 1e3,
                "wall_ms_per_step": result.wall_s / result.num_steps * 1e3,
                "num_steps": result.num_steps,
                "num_compilations": result.num_compilations,
                "tokens": [list(o.output_token_ids) for o in result.outputs],
            }
    return best


def main(argv: Sequence[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    counts = [int(d) for d in FLAGS.devices if d.isdigit() and int(d) > 0]
    if len(counts) != len(FLAGS.devices):
        exit_error(PROG, f"--devices must be positive ints, got {','.join(FLAGS.devices)}")
    prompts = shared_prefix_prompts(
        num_requests=FLAGS.num_requests, num_prefixes=2, prefix_len=64, suffix_len=(8, 48), vocab_size=512, seed=0
    )
    try:
        results = {n: measure(n, prompts) for n in counts}
    except JaxkvError as err:
        exit_error(PROG, err)
    base = results[counts[0]]
    print(f"{FLAGS.model} on {jax.default_backend()}: {FLAGS.num_requests} requests, {base['num_steps']} steps")
    vs = f"vs {counts[0]} device(s)"
    print(
        f"| devices | jaxkv host ms/step | {vs} | JAX call ms/step | {vs} | wall ms/step | compilations while timed |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, r in results.items():
        r["host_ratio"] = r["host_ms_per_step"] / base["host_ms_per_step"]
        r["dispatch_ratio"] = r["dispatch_ms_per_step"] / base["dispatch_ms_per_step"]
        print(
            f"| {n} | {r['host_ms_per_step']:.2f} | {r['host_ratio']:.2f}x | {r['dispatch_ms_per_step']:.2f} "
            f"| {r['dispatch_ratio']:.2f}x | {r['wall_ms_per_step']:.2f} | {r['num_compilations']} |"
        )
    same = all(r["tokens"] == base["tokens"] for r in results.values())
    print(f"tokens identical on every mesh: {'yes' if same else 'NO'}")
    if FLAGS.out:
        flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
        with open(FLAGS.out, "w") as f:
            json.dump({"flags": flag_values, "device": jax.default_backend(), "results": results}, f, indent=2)
        print(f"wrote {FLAGS.out}")
    if not same:
        exit_error(PROG, "the tokens differ between meshes", status=1)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))

"""Old (main before this change) and new decode step, gpt2 batch 32, live 128, capacity 192,
in ONE process, timed in turns: marginal seconds per step from runs of 8 and 16 steps."""
import sys, time, functools, statistics
sys.path.insert(0, "/tmp/oldpkg"); sys.path.insert(0, "/work/main/benchmarks")
import jax, jax.numpy as jnp, numpy as np
from speed import decode_runner, preset
from gpt_jax import init_params
import old_inference.engine as OE

config = preset("gpt2"); params = init_params(config, jax.random.key(0))
B, CAP, LIVE = 32, 192, 128

def old_runner(steps):
    shape = (B, config.n_layers, config.kv_heads, CAP, config.head_dim)
    @jax.jit
    def run(params, cache):
        _, step_fn = OE.cached_model(params, config, CAP, jnp.float32)
        hold = jnp.zeros((B,), bool)
        def body(carry, _):
            tokens, cache = carry
            logits, cache = step_fn(tokens, cache, hold)
            return (jnp.argmax(logits, axis=-1).astype(jnp.int32), cache), None
        return jax.lax.scan(body, (jnp.zeros((B,), jnp.int32), cache), None, length=steps)[0]
    cache = OE.page(OE.LoopCache(k=jnp.zeros(shape), v=jnp.zeros(shape),
                                 lengths=jnp.full((B,), LIVE, jnp.int32), overflow=jnp.zeros((B,), bool)))
    return functools.partial(run, params, cache)

runners = {"old": {n: old_runner(n) for n in (8, 16)},
           "new": {n: decode_runner(params, config, B, CAP, LIVE, n) for n in (8, 16)}}
def once(f):
    t = time.perf_counter(); jax.block_until_ready(f()); return time.perf_counter() - t
for name in runners:
    for n in (8, 16): once(runners[name][n])  # compile
res = {"old": [], "new": []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for name in ("old", "new"):
        short = min(once(runners[name][8]) for _ in range(2)); long = min(once(runners[name][16]) for _ in range(2))
        res[name].append((long - short) / 8 * 1e3)
    print(r, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
med = {k: statistics.median(v) for k, v in res.items()}
print("median ms/step", med, "new/old", med["new"] / med["old"])

"""Stateful fuzz of the three managers and the CPU ops on shapes off the usual grid, against
a dense shadow (the driver: ``offgrid_driver.py``; its hostile calls:
``offgrid_hostile_calls.py``).

Each run is a seeded random sequence of claim / fetch + append + attention (decode or
prefill, through a ``StepPlan`` or the ops) / multistep / step / fork (copy-on-write: the
parent's pages keep every byte) / pop / release / prefix-cache hits / export + import into a
second manager (paged), host and disk tiers of the prefix cache, and reset / step_inputs / commit / evict / set_active_batch_size
(linear), with hostile op calls, wrong step tokens and stale inputs mixed in (each a typed
kvtvm error that changes neither the manager nor a byte of the cache). After every
operation every live sequence's K/V read back from the cache equal the shadow's, as stored
(8-bit layers: the reference quantizer's values, exactly), and every attention output is
within ``TOL`` of float64 numpy attention over the shadow. Memory arithmetic
(``bytes_per_token``, ``bytes_per_page``, ``estimated_memory_size``,
``infer_optimal_batch_size``) equals what the manager allocated.

``make test`` runs the fixed shape groups ``SHAPES`` (one seed, 30 operations each) (page_size 1, 3, 7, 64, 1000; head_dim 1, 3,
24, 48, 80, 96, 200, 256; 1, 3, 5 KV heads; GQA 1, 3, 7; 1 and 3 layers; float32 / float16 /
bfloat16 with dense, int8, float8_e4m3fn, K-only, V-only and mixed storage and skipped
layers). The ``slow`` test runs ``MORE_SHAPES``, ``SHAPES`` again with other seeds and
``KVTVM_OFFGRID_SHAPES`` (default 12) random shapes from the same grid
(``KVTVM_OFFGRID_SEED`` picks them).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from offgrid_driver import Driver, Shape  # noqa: E402

I8, F8 = "int8", "float8_e4m3fn"

SHAPES = [
    Shape("paged", "float32", (None, None), (), H=3, D=3, G=3, L=1, P=3, MB=3, S=20,
          prefix=True),
    Shape("paged", "float16", (I8, F8), (0,), H=5, D=80, G=1, L=3, P=7, MB=5, S=40,
          prefix=True),
    Shape("paged", "bfloat16", (F8, None), (), H=1, D=256, G=7, L=1, P=1, MB=1, S=9),
    Shape("paged", "float32", (None, I8), (-1,), H=3, D=200, G=1, L=3, P=64, MB=3, S=17,
          prefix=True, num_pages=2),
    Shape("paged", "float16", (I8, I8), (), H=1, D=1, G=3, L=1, P=1000, MB=5, S=40),
    Shape("continuous", "bfloat16", (None, None), (), H=5, D=24, G=7, L=3, MB=1, S=13),
    Shape("continuous", "float32", (I8, I8), (0,), H=3, D=96, G=3, L=1, MB=5, S=9),
    Shape("linear", "float16", (F8, I8), (0,), H=5, D=48, G=1, L=3, MB=3, S=11),
    # evicted prefix pages descend to a host tier and rise again on a hit
    Shape("paged", "float32", (None, None), (), H=3, D=3, G=3, L=1, P=3, MB=3, S=20,
          prefix=True, num_pages=6, tiers="host"),
]
#: more fixed groups, in the slow run
MORE_SHAPES = [
    Shape("paged", "bfloat16", (None, None), (), H=5, D=24, G=7, L=1, P=1, MB=3, S=9,
          prefix=True, num_pages=7),
    Shape("continuous", "float16", (F8, F8), (), H=1, D=48, G=1, L=1, MB=3, S=2),
    Shape("linear", "float16", (None, None), (), H=5, D=48, G=1, L=3, MB=3, S=11),
    Shape("linear", "bfloat16", (F8, I8), (), H=1, D=80, G=7, L=1, MB=5, S=40),
    Shape("linear", "float32", (I8, None), (0, 2), H=3, D=3, G=3, L=3, MB=1, S=17),
    Shape("paged", "float16", (I8, F8), (0,), H=5, D=80, G=1, L=3, P=7, MB=5, S=40,
          prefix=True, num_pages=9, tiers="disk"),
    # prompts up to S: the parallel kernel variants and (CPU) decode KV splits
    Shape("paged", "float16", (I8, None), (), H=5, D=256, G=3, L=1, P=64, MB=3, S=1100,
          prefix=True, long=True),
    Shape("continuous", "float32", (F8, I8), (), H=1, D=96, G=7, L=1, MB=3, S=1200,
          long=True),
    Shape("linear", "float16", (None, None), (), H=5, D=80, G=3, L=1, MB=3, S=900, long=True),
]


def _id(s: Shape) -> str:
    st = "/".join(x or s.dtype for x in s.storage)
    return (f"{s.strategy}-{s.dtype}-{st}-H{s.H}D{s.D}G{s.G}L{s.L}"
            f"{'P' + str(s.P) if s.strategy == 'paged' else ''}-mb{s.MB}-S{s.S}")


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_offgrid_shapes_match_the_dense_shadow(shape):
    counts = Driver(shape, 3 if shape.tiers else 0).run(30)  # (seed 3: hits from the tier)
    assert counts.get("kv_checked") and counts.get("attn_checked") and counts.get("refused"), \
        counts
    if shape.tiers:
        assert counts["tier_hits"], counts


GRID = dict(P=[1, 3, 7, 64, 1000], D=[1, 3, 24, 48, 80, 96, 200, 256], H=[1, 3, 5],
            G=[1, 3, 7], L=[1, 3], MB=[1, 3, 5], S=[1, 2, 9, 17, 40])
STORAGES = [(None, None), (I8, None), (None, I8), (F8, F8), (I8, I8), (I8, F8), (F8, None)]


def random_shape(r: random.Random) -> Shape:
    strategy = r.choice(["paged", "paged", "continuous", "linear"])
    L = r.choice(GRID["L"])
    skip = r.choice([(), (), (0,), (-1,), (0, 2)]) if L == 3 else r.choice([(), (0,)])
    storage = r.choice(STORAGES)
    if storage == (None, None):  # layers to keep at full precision need an 8-bit cache
        skip = ()
    shape = Shape(strategy, r.choice(["float32", "float16", "bfloat16"]), storage,
                  skip, **{k: r.choice(v) for k, v in GRID.items() if k != "L"}, L=L,
                  prefix=strategy == "paged" and r.random() < 0.6)
    if strategy == "paged" and r.random() < 0.4:
        shape = dataclasses.replace(shape, num_pages=r.randint(1, 12))
    return shape


@pytest.mark.slow
def test_offgrid_random_shapes():
    r = random.Random(int(os.environ.get("KVTVM_OFFGRID_SEED", "0")))
    shapes = MORE_SHAPES + SHAPES
    shapes += [random_shape(r) for _ in range(int(os.environ.get("KVTVM_OFFGRID_SHAPES",
                                                                  "12")))]
    for i, shape in enumerate(shapes):
        try:
            Driver(shape, i).run(30)
        except Exception as err:
            raise AssertionError(f"{shape} seed {i}") from err

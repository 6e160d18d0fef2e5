"""What a user sees when printing params, managers, fetched inputs and step plans: the key
numbers, never a cache's contents; and ``dir(kvtvm)`` lists the names ``kvtvm`` exports."""

import kvtvm
from kvtvm import KVCacheParams
from kvtvm.manager import (BatchItem, ContinuousBatchingKVCacheManager, LinearKVCache,
                           PagedKVCacheManager)
from kvtvm.plan import plan_step


def test_params_repr_is_the_constructor_call():
    for params in (
            KVCacheParams("float16", n_kv_heads=8, head_dim=128, cache_strategy="paged",
                          page_size=32),
            KVCacheParams("float32", n_kv_heads=2, head_dim=64, cache_strategy="paged",
                          page_size=16, enable_prefix_caching=True, cache_dtype="int8",
                          v_cache_dtype="float8_e4m3fn", skip_layers=(0, -1)),
            KVCacheParams("bfloat16", n_kv_heads=4, head_dim=64, cache_strategy="linear",
                          k_cache_dtype="int8")):
        text = repr(params)
        assert eval(text, {"KVCacheParams": KVCacheParams}) == params, text
    plain = repr(KVCacheParams("float16", n_kv_heads=8, head_dim=128,
                               cache_strategy="continuous"))
    assert plain == ("KVCacheParams('float16', n_kv_heads=8, head_dim=128, "
                     "cache_strategy='continuous')")


def test_manager_reprs_show_sizes_and_occupancy():
    params = KVCacheParams("float32", n_kv_heads=2, head_dim=64, cache_strategy="paged",
                           page_size=16, enable_prefix_caching=True, cache_dtype="int8")
    mgr = PagedKVCacheManager(params, max_batch_size=4, max_seq_len=256, num_layers=3,
                              num_pages=40)
    assert repr(mgr) == ("PagedKVCacheManager(float32, 2 kv heads x 64, int8 K/V, layers=3, "
                         "max_batch_size=4, max_seq_len=256, page_size=16, pages=40 (40 free), "
                         "prefix cache (0 cached), devices=[cpu], sequences=0)")
    (seq,) = mgr.claim(1)
    mgr.fetch([BatchItem(seq, list(range(20)))])
    assert "pages=40 (38 free)" in repr(mgr) and "sequences=1" in repr(mgr)
    cont = ContinuousBatchingKVCacheManager(
        KVCacheParams("float16", n_kv_heads=8, head_dim=128, cache_strategy="continuous"),
        max_batch_size=2, max_seq_len=64, num_layers=1)
    assert repr(cont) == ("ContinuousBatchingKVCacheManager(float16, 8 kv heads x 128, "
                          "layers=1, max_batch_size=2, max_seq_len=64, devices=[cpu], "
                          "sequences=0)")
    lin = LinearKVCache(KVCacheParams("float32", n_kv_heads=2, head_dim=64,
                                      cache_strategy="linear"),
                        max_batch_size=3, max_seq_len=32, num_layers=2)
    lin.reset_for_new_sequences([0, 0])
    assert repr(lin).endswith("max_batch_size=3, max_seq_len=32, devices=[cpu], "
                              "active_batch_size=2)")


def test_inputs_and_plan_reprs_are_short_and_say_stale():
    params = KVCacheParams("float32", n_kv_heads=2, head_dim=64, cache_strategy="paged",
                           page_size=16)
    mgr = PagedKVCacheManager(params, max_batch_size=4, max_seq_len=1024, num_layers=2)
    a, b = mgr.claim(2)
    batch = [BatchItem(a, [1, 2, 3]), BatchItem(b, [4])]
    (inp,) = mgr.fetch(batch)
    text = repr(inp)
    assert len(text) < 300, text   # the cache tensor's contents are not printed
    assert text == ("RaggedKVCacheInputs(paged, seq_ids=[0, 1], cache_lengths=[0, 0], "
                    f"new_tokens=[3, 1], num_cached_tokens=[0, 0], lookup_table=int32[2, 64], "
                    f"blocks=float32{list(inp.blocks.shape)} on cpu, device_index=0, live)")
    assert repr(plan_step(inp)) == "StepPlan(prefill, layers=2, seq_ids=[0, 1], new_tokens=[3, 1])"
    mgr.step(batch)
    assert repr(inp).endswith("stale)")


def test_dir_lists_the_lazy_exports():
    names = dir(kvtvm)
    assert set(kvtvm.__all__) <= set(names)
    for name in kvtvm.__all__:
        assert getattr(kvtvm, name) is not None, name

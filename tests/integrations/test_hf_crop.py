"""transformers on kvtvm past one plain ``generate``: ``crop`` under assisted generation and
prompt lookup decoding, and a cache carried into the next turn of a chat -- each equal token
for token to transformers' own generate, and every bad ``crop`` typed and harmless."""

import pytest
import torch
from helpers import on_kvtvm

from kvtvm.engine import build_toy_model
from kvtvm.errors import InvalidArgumentError

hf = pytest.importorskip("kvtvm.integrations.hf")
import transformers  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def toy():
    return build_toy_model(num_layers=2)


def _first_layer_of(target):
    """``target`` cut to its first layer (same vocabulary, embeddings and head): a smaller
    model that agrees with it often but not always, so drafts are partly accepted. It drafts 5
    tokens every time."""
    config = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": 1})
    model = target.__class__(config).eval()
    model.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.1.")})
    model.generation_config.num_assistant_tokens = 5
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def _windowed():
    """A 2-layer Mistral with a 4-token sliding window (random, std 0.1 weights)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
        initializer_range=0.1, pad_token_id=0, eos_token_id=None)).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def draft(toy):
    return _first_layer_of(toy)


def _spy_crops(kv):
    """Record every ``crop`` argument of ``kv``."""
    calls, crop = [], kv.crop
    kv.crop = lambda n: (calls.append(n), crop(n))[1]
    return calls


def _random_ids(seed, *shape):
    return torch.randint(3, 1000, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind,cache", [("llama", "paged"), ("llama", "continuous"),
                                        ("windowed", "paged")])
def test_assisted_generation_equals_greedy(toy, draft, kind, cache):
    if kind == "windowed":
        toy = _windowed()
        draft = _first_layer_of(toy)
    ids = _random_ids(3, 1, 12)
    want = toy.generate(ids, max_new_tokens=16, **GREEDY)
    kv = hf.KVTVMCache(toy, max_seq_len=40, cache=cache, page_size=4)
    crops = _spy_crops(kv)
    got = on_kvtvm(toy, lambda: toy.generate(ids, assistant_model=draft, cache=kv,
                                              max_new_tokens=16, **GREEDY))
    assert torch.equal(got, want)
    assert -5 in crops and any(-5 < c < 0 for c in crops)   # rejected and partly accepted
    held = got.shape[1] - 1                                 # the last token is never fed
    assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [held - 1]    # + 1 uncommitted


def test_prompt_lookup_decoding_equals_greedy(toy):
    ids = _random_ids(4, 1, 10)
    ids = torch.cat([ids, ids[:, :6], ids[:, :6]], dim=1)   # n-grams to look up
    want = toy.generate(ids, max_new_tokens=16, **GREEDY)
    kv = hf.KVTVMCache(toy, max_seq_len=48, page_size=4)
    crops = _spy_crops(kv)
    got = on_kvtvm(toy, lambda: toy.generate(ids, prompt_lookup_num_tokens=4, cache=kv,
                                              max_new_tokens=16, **GREEDY))
    assert torch.equal(got, want)
    assert any(c < 0 for c in crops)


def _state(kv):
    m = kv.mgr
    return (sorted(m.slots_remaining), list(kv.seq_ids), kv.length, kv.pads.tolist(),
            [m.cache_length(s) for s in kv.seq_ids])


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_crop_then_refeed_gives_the_same_logits(toy, cache):
    """Rows of 4 tokens (left-padded) and of 6 (a hole at position 5): crop the last 3
    positions, feed them again: the logits at every token equal sdpa's over the whole chunk;
    a crop into a row's pads keeps them pads."""
    ids = _random_ids(5, 2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, 5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = toy(ids, attention_mask=mask, position_ids=pos).logits
        kv = hf.KVTVMCache(toy, 16, cache=cache, max_batch_size=2, page_size=2)

        def run():
            toy(ids, attention_mask=mask, position_ids=pos, cache=kv)
            kv.crop(-3)
            assert _state(kv)[2:] == (4, [3, 0], [1, 4])
            return toy(ids[:, 4:], attention_mask=mask, position_ids=pos[:, 4:],
                       cache=kv).logits

        got = on_kvtvm(toy, run)
    real = mask[:, 4:].bool()
    torch.testing.assert_close(got[real], want[:, 4:][real], rtol=1e-4, atol=1e-4)
    assert _state(kv)[2:4] == (7, [3, 1])
    kv.crop(-6)                        # row 0: 2 of its pads and all 4 tokens; row 1: 5 tokens
    assert _state(kv)[2:] == (1, [1, 0], [0, 1])
    kv.crop(-1)
    assert _state(kv)[2:] == (0, [0, 0], [0, 0])


def test_bad_crop_refused_before_any_change(toy):
    kv = hf.KVTVMCache(toy, 16, max_batch_size=2)
    ids = _random_ids(6, 2, 5)
    on_kvtvm(toy, lambda: toy(ids, cache=kv))
    before = _state(kv)
    for bad, match in ((2, "an int <= 0"), (1.0, "an int <= 0"), (True, "an int <= 0"),
                       (None, "an int <= 0"), (-6, "at least -5")):
        with pytest.raises(InvalidArgumentError, match=f"tokens_to_remove.*{match}"):
            kv.crop(bad)
        assert _state(kv) == before
    kv.crop(0)
    assert _state(kv) == before
    assert kv.is_croppable


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_second_turn_reuses_the_cache(toy, cache):
    """Turn 2 passes turn 1's output + the user's next tokens with the same cache: transformers
    feeds only what the cache lacks, and the answer equals a fresh generate of the whole chat."""
    ids, user = _random_ids(7, 1, 9), _random_ids(8, 1, 4)
    kv = hf.KVTVMCache(toy, max_seq_len=40, cache=cache, page_size=4)
    turn1 = on_kvtvm(toy, lambda: toy.generate(ids, cache=kv, max_new_tokens=6, **GREEDY))
    chat = torch.cat([turn1, user], dim=1)
    fed = []
    hook = toy.register_forward_pre_hook(lambda m, a, k: fed.append(k["input_ids"].shape[1]),
                                         with_kwargs=True)
    try:
        turn2 = on_kvtvm(toy, lambda: toy.generate(chat, cache=kv, max_new_tokens=6, **GREEDY))
    finally:
        hook.remove()
    assert torch.equal(turn2, toy.generate(chat, max_new_tokens=6, **GREEDY))
    assert fed[0] == 1 + user.shape[1]            # turn 1's last token + the user's
    assert kv.length == turn2.shape[1] - 1


def test_second_turn_of_a_left_padded_batch_and_reset(toy):
    g = torch.Generator().manual_seed(9)
    ids, mask = torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long)
    for b, n in enumerate([4, 8, 6]):
        ids[b, 8 - n:], mask[b, 8 - n:] = torch.randint(3, 1000, (n,), generator=g), 1
    kv = hf.KVTVMCache(toy, max_seq_len=32, max_batch_size=3)
    turn1 = on_kvtvm(toy, lambda: toy.generate(ids, attention_mask=mask, cache=kv,
                                                max_new_tokens=5, **GREEDY))
    chat = torch.cat([turn1, _random_ids(10, 3, 3)], dim=1)
    chat_mask = torch.cat([mask, torch.ones(3, chat.shape[1] - 8, dtype=torch.long)], dim=1)
    turn2 = on_kvtvm(toy, lambda: toy.generate(chat, attention_mask=chat_mask, cache=kv,
                                                max_new_tokens=5, **GREEDY))
    want = toy.generate(chat, attention_mask=chat_mask, max_new_tokens=5, **GREEDY)
    assert torch.equal(turn2, want)
    # reset: the same cache serves a new batch of another size
    kv.reset()
    assert sorted(kv.mgr.slots_remaining) == [0, 1, 2] and kv.length == 0
    other = _random_ids(11, 2, 6)
    got = on_kvtvm(toy, lambda: toy.generate(other, cache=kv, max_new_tokens=5, **GREEDY))
    assert torch.equal(got, toy.generate(other, max_new_tokens=5, **GREEDY))


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_deepcopy_of_a_prompt_cache_serves_each_continuation(toy, cache):
    """transformers' prompt reuse: one forward over a (left-padded) shared prefix, then
    ``copy.deepcopy(prompt_cache)`` for each continuation. Each copy has a manager of its own
    with the rows' pages/blocks copied; tokens equal DynamicCache's doing the same, and the
    prompt cache is untouched (deepcopy once raised: a manager's lock cannot be pickled)."""
    import copy

    from transformers import DynamicCache

    g = torch.Generator().manual_seed(15)
    ids, mask = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    for b, n in enumerate([6, 9]):
        ids[b, 9 - n:], mask[b, 9 - n:] = torch.randint(3, 1000, (n,), generator=g), 1
    suffixes = [torch.randint(3, 1000, (2, n), generator=g) for n in (3, 5)]

    def run(prompt_cache):
        with torch.no_grad():
            toy(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                cache=prompt_cache)
        outs = []
        for suf in suffixes:
            full = torch.cat([mask, torch.ones_like(suf)], 1)
            outs.append(toy.generate(torch.cat([ids, suf], 1), attention_mask=full,
                                     cache=copy.deepcopy(prompt_cache),
                                     max_new_tokens=5, **GREEDY))
        return outs

    want = run(DynamicCache(config=toy.config))
    kv = hf.KVTVMCache(toy, max_seq_len=24, cache=cache, max_batch_size=2, page_size=4)
    got = on_kvtvm(toy, lambda: run(kv))
    for w, g_ in zip(want, got):
        assert torch.equal(w, g_)
    assert _state(kv) == ([], kv.seq_ids, 9, [3, 0], [6, 9])
    twin = copy.deepcopy(kv)
    assert twin.mgr is not kv.mgr and twin.layers[0].owner is twin
    assert _state(twin)[2:] == _state(kv)[2:]


def test_second_turn_with_left_padded_user_tokens(toy):
    """Users' next messages of 1, 4 and 2 tokens, left-padded to the batch: the pads sit between
    turns (holes the cache remembers, never appended). Equal to transformers' generate over the
    same chat and mask, and to each row's conversation generated alone."""
    g = torch.Generator().manual_seed(12)
    ids, mask = torch.zeros(3, 7, dtype=torch.long), torch.zeros(3, 7, dtype=torch.long)
    for b, n in enumerate([7, 3, 5]):
        ids[b, 7 - n:], mask[b, 7 - n:] = torch.randint(3, 1000, (n,), generator=g), 1
    kv = hf.KVTVMCache(toy, max_seq_len=32, max_batch_size=3, page_size=4)
    turn1 = on_kvtvm(toy, lambda: toy.generate(ids, attention_mask=mask, cache=kv,
                                                max_new_tokens=4, **GREEDY))
    user, user_mask = torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)
    for b, n in enumerate([1, 4, 2]):
        user[b, 4 - n:], user_mask[b, 4 - n:] = torch.randint(3, 1000, (n,), generator=g), 1
    chat = torch.cat([turn1, user], dim=1)
    chat_mask = torch.cat([mask, torch.ones(3, 4, dtype=torch.long), user_mask], dim=1)
    turn2 = on_kvtvm(toy, lambda: toy.generate(chat, attention_mask=chat_mask, cache=kv,
                                                max_new_tokens=5, **GREEDY))
    assert torch.equal(turn2, toy.generate(chat, attention_mask=chat_mask, max_new_tokens=5,
                                           **GREEDY))
    for b in range(3):
        alone = chat[b][chat_mask[b].bool()][None]
        assert torch.equal(toy.generate(alone, max_new_tokens=5, **GREEDY)[0, -5:],
                           turn2[b, -5:])
    assert kv.pads.tolist() == [3, 4 + 0, 2 + 2]
    fed = [n + 4 + u + 4 for n, u in zip([7, 3, 5], [1, 4, 2])]  # prompt, turn 1, user, turn 2
    assert [kv.mgr.cache_length(s) + 1 for s in kv.seq_ids] == fed    # + the last, uncommitted


def test_pads_between_turns_refused_with_a_sliding_window():
    """transformers counts pad positions in a sliding window, kvtvm counts tokens: with a
    window, pads after a row's tokens are refused (typed, nothing changes); pads before any
    token of the row are fine."""
    model = _windowed()
    ids = _random_ids(13, 2, 5)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kv = hf.KVTVMCache(model, 16, max_batch_size=2)

    def run():
        model(ids, attention_mask=mask, cache=kv)
        before = _state(kv)
        m = torch.cat([mask, torch.tensor([[1, 1], [0, 1]])], dim=1)
        with pytest.raises(InvalidArgumentError, match=r"row 1 \(new positions\).*sliding"):
            model(ids[:, :2], attention_mask=m, cache=kv)
        assert _state(kv) == before

    on_kvtvm(model, run)


def test_a_forward_without_the_cache_never_touches_it(toy, draft):
    """A draft model switched to kvtvm but run without a KVTVMCache (transformers gives the
    assistant its own DynamicCache) is refused, typed, and the target's cache is unchanged."""
    ids = _random_ids(14, 1, 6)
    kv = hf.KVTVMCache(toy, 16)
    on_kvtvm(toy, lambda: toy(ids, cache=kv))
    before = _state(kv)
    for cache in (None, "dynamic"):
        kw = {"use_cache": False} if cache is None else {}
        with pytest.raises(InvalidArgumentError, match=r"needs a KVTVMCache.*cache="):
            on_kvtvm(draft, lambda: draft(ids[:, :3], **kw))
        assert _state(kv) == before


@pytest.mark.parametrize("cache", ["static", "sliding_window", "StaticCache"])
@pytest.mark.parametrize("padded", [True, False])
def test_generate_on_a_transformers_cache_is_refused_typed(toy, cache, padded):
    """generate on kvtvm attention with a cache transformers builds its masks for ahead of the
    forward (a static one) is refused with the cure, typed (it was an AttributeError from
    transformers' mask code), and the model then generates on a KVTVMCache as sdpa does."""
    ids = _random_ids(17, 2, 5)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=3, pad_token_id=0)
    extra = (dict(cache_implementation=cache) if cache != "StaticCache" else dict(
        cache=transformers.StaticCache(config=toy.config, max_cache_len=16)))
    with pytest.raises(InvalidArgumentError, match=r"needs a KVTVMCache.*cache="):
        on_kvtvm(toy, lambda: toy.generate(ids, **kw, **extra))
    got = on_kvtvm(toy, lambda: toy.generate(ids, **kw, cache=hf.KVTVMCache(toy, 16)))
    assert torch.equal(got, toy.generate(ids, **kw))


@pytest.mark.parametrize("refused", ["4-D mask", "too long"])
def test_a_forward_after_a_refused_one_never_touches_its_cache(toy, refused):
    """A forward refused inside the kvtvm attention (a prepared 4-D mask, more tokens than
    max_seq_len) leaves nothing behind: a later forward without a KVTVMCache (use_cache=False,
    a draft's own cache) is refused with the cure, and the refused forward's cache is
    unchanged. (It once picked up the refused forward's K/V, fetched into that cache and died
    in a reshape.)"""
    ids = _random_ids(15, 1, 6)
    kv = hf.KVTVMCache(toy, 9)
    on_kvtvm(toy, lambda: toy(ids, cache=kv))
    kv._settle()
    before = _state(kv)
    bad = (dict(attention_mask=torch.zeros(1, 1, 2, 8)) if refused == "4-D mask"
           else dict(input_ids=_random_ids(16, 1, 4)))
    with pytest.raises(InvalidArgumentError):
        on_kvtvm(toy, lambda: toy(**{"input_ids": ids[:, :2], **bad}, cache=kv))
    for kw in ({"use_cache": False}, {}):
        with pytest.raises(InvalidArgumentError, match=r"needs a KVTVMCache.*cache="):
            on_kvtvm(toy, lambda: toy(ids[:, :3], **kw))
    kv._settle()
    assert _state(kv) == before


@pytest.mark.parametrize("cache", ["paged", "continuous"])
def test_a_forward_that_fails_midway_is_rolled_back(toy, cache):
    """An exception in the model after layer 0 appended but before the last layer did (here:
    in layer 0's MLP) leaves the step's tokens in some layers only; the next forward rolls
    them back, so a retry of the same chunk gives sdpa's logits and every row holds what it
    held before. (An exception after the last layer's attention leaves every layer appended,
    as transformers' own caches do.)"""
    ids = _random_ids(9, 2, 6)
    with torch.no_grad():
        want = toy(ids).logits
        kv = hf.KVTVMCache(toy, 16, cache=cache, max_batch_size=2, page_size=4)
        mlp = toy.model.layers[0].mlp

        def boom(*args, **kwargs):
            raise RuntimeError("injected")

        def run():
            toy(ids[:, :4], cache=kv)
            before = _state(kv)
            handle = mlp.register_forward_pre_hook(boom)
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    toy(ids[:, 4:], cache=kv)
            finally:
                handle.remove()
            got = toy(ids[:, 4:], cache=kv).logits
            nxt = toy(more, cache=kv).logits  # commits the retry; every layer at 6 tokens
            return before, got, nxt

        more = _random_ids(10, 2, 1)
        full = toy(torch.cat([ids, more], 1)).logits
        before, got, nxt = on_kvtvm(toy, run)
    torch.testing.assert_close(got, want[:, 4:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nxt, full[:, 6:], rtol=1e-4, atol=1e-4)
    assert before[2] == 4 and _state(kv)[2] == 7
    assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [6, 6]  # the last one pending



def _padded_batch(seed, length, pad_row, pads):
    """Two random rows, ``pads`` left pads in ``pad_row``: ids, mask, position ids."""
    ids = _random_ids(seed, 2, length)
    mask = torch.ones_like(ids)
    mask[pad_row, :pads] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _fails_in_layer_0(toy, forward):
    """Run ``forward`` with layer 0's MLP raising (an exception after layer 0's attention)."""
    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    handle = toy.model.layers[0].mlp.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            forward()
    finally:
        handle.remove()


def test_a_left_padded_forward_that_fails_midway_is_retried(toy):
    """The rollback with a padded batch: the failed forward had extended the rows' token mask,
    so the retry's mask was checked against it (an untyped shape error); the unfinished
    forward is now rolled back before the retry is checked, and the retry gives sdpa's
    logits."""
    ids, mask, pos = _padded_batch(16, 8, 0, 3)
    with torch.no_grad():
        want = toy(ids, attention_mask=mask, position_ids=pos).logits
        kv = hf.KVTVMCache(toy, 16, max_batch_size=2, page_size=4)

        def run():
            toy(ids[:, :5], attention_mask=mask[:, :5], position_ids=pos[:, :5], cache=kv)
            _fails_in_layer_0(toy, lambda: toy(ids[:, 5:], attention_mask=mask,
                                               position_ids=pos[:, 5:], cache=kv))
            return toy(ids[:, 5:], attention_mask=mask, position_ids=pos[:, 5:],
                       cache=kv).logits

        got = on_kvtvm(toy, run)
    torch.testing.assert_close(got, want[:, 5:], rtol=1e-4, atol=1e-4)
    assert kv.length == 8 and kv.pads.tolist() == [3, 0]



@pytest.mark.parametrize("padded", [False, True])
def test_a_first_forward_that_fails_midway_is_retried(toy, padded):
    """The first forward on a cache claimed the rows' sequences; its rollback restored the rows
    of an empty cache but kept the sequences, so the retry (and every later forward) failed
    with an untyped numpy broadcast error."""
    ids, mask, pos = _padded_batch(17, 9, 1, 4 if padded else 0)
    with torch.no_grad():
        want = toy(ids, attention_mask=mask, position_ids=pos).logits
        kv = hf.KVTVMCache(toy, 16, max_batch_size=2, page_size=4)

        def run():
            _fails_in_layer_0(toy, lambda: toy(ids[:, :6], attention_mask=mask[:, :6],
                                               position_ids=pos[:, :6], cache=kv))
            first = toy(ids[:, :6], attention_mask=mask[:, :6], position_ids=pos[:, :6],
                        cache=kv).logits
            return first, toy(ids[:, 6:], attention_mask=mask, position_ids=pos[:, 6:],
                              cache=kv).logits

        first, rest = on_kvtvm(toy, run)
    keep = mask.bool()
    torch.testing.assert_close(first[keep[:, :6]], want[:, :6][keep[:, :6]], rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(rest, want[:, 6:], rtol=1e-4, atol=1e-4)
    assert kv.length == 9 and kv.pads.tolist() == [0, 4 if padded else 0]
    # (the last forward is pending until the next one commits it)
    assert [kv.mgr.cache_length(s) for s in kv.seq_ids] == [6, 2 if padded else 6]

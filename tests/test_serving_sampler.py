"""The device sampler against exact probabilities, and its per-row keys, masks and log-probabilities."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.core.request import Request
from jaxkv.device.metadata import Buckets
from jaxkv.serving.engine import Engine
from jaxkv.serving.penalties import PenaltyInputsError, apply_penalties
from jaxkv.serving.sampler import RowSampling, greedy_inputs, sample, sampling_inputs
from jaxkv.serving.sampling_params import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")

PROBS = np.array([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
"""A fixed small distribution: distinct probabilities, so every filter cuts somewhere."""
DRAWS = 20_000
P_VALUE = 1e-6
"""A chi-square test this strict fails a right sampler once in a million runs; a wrong one
(the negative controls) is off by far more than the noise of 20 000 draws."""

_sample = jax.jit(sample)


def exact(params: SamplingParams) -> np.ndarray:
    """The distribution ``params`` define over :data:`PROBS`, written from the definitions."""
    p = PROBS ** (1 / params.temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    k = params.top_k or len(p)
    mass = 0.0
    for rank, token in enumerate(order[:k]):
        if rank and mass >= params.top_p * p[order[:k]].sum():
            break
        keep[token] = True
        mass += p[token]
    keep &= p >= params.min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draws(params: SamplingParams, *, first_seed: int = 0) -> np.ndarray:
    """Counts per token of :data:`DRAWS` draws, each row with its own seed."""
    logits = jnp.asarray(np.tile(np.log(PROBS), (DRAWS, 1)), jnp.float32)
    rows = [RowSampling(params, first_seed + i, 7) for i in range(DRAWS)]
    tokens = np.asarray(_sample(logits, sampling_inputs(rows, DRAWS)).token_ids)
    return np.bincount(tokens, minlength=len(PROBS))


def p_value(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square goodness of fit over the tokens ``expected`` can draw (none drawn elsewhere)."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    return float(scipy_stats.chisquare(counts[support], DRAWS * expected[support]).pvalue)


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.6, top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(top_p=0.5),
    SamplingParams(min_p=0.3),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.2),
]


@pytest.mark.slow
@pytest.mark.parametrize("params", CASES, ids=repr)
def test_draws_follow_the_exact_distribution(params):
    assert p_value(draws(params), exact(params)) > P_VALUE


@pytest.mark.slow
@pytest.mark.parametrize(
    "drawn, claimed",
    [
        (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)),  # temperature ignored
        (SamplingParams(top_k=4), SamplingParams(top_k=3)),  # top-k off by one
        (SamplingParams(top_p=0.9), SamplingParams(top_p=0.7)),  # one token too many in the head
        (
            SamplingParams(temperature=1.3, top_k=5, top_p=0.9),
            SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.4),
        ),
    ],
    ids=["temperature", "top_k", "top_p", "min_p"],
)
def test_a_wrong_sampler_fails_the_same_test(drawn, claimed):
    counts = draws(drawn)
    expected = exact(claimed)
    support = expected > 0
    leaked = counts[~support].sum() > 0
    assert leaked or scipy_stats.chisquare(counts[support], DRAWS * expected[support]).pvalue < P_VALUE


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    rng = np.random.default_rng(0)
    seeded = RowSampling(SamplingParams(temperature=1.0, seed=5), 5, 11)
    batches = []
    for others in (0, 3, 7):
        logits = rng.normal(size=(8, 64)).astype(np.float32)
        logits[others % 8] = np.linspace(-1, 1, 64)  # the seeded row's logits, at different rows
        rows = [RowSampling(SamplingParams(temperature=2.0), int(rng.integers(99)), int(rng.integers(99)))] * 8
        rows[others % 8] = seeded
        batches.append(int(_sample(jnp.asarray(logits), sampling_inputs(rows, 8)).token_ids[others % 8]))
    assert len(set(batches)) == 1
    logits = jnp.asarray(np.tile(np.linspace(-1, 1, 64), (8, 1)), jnp.float32)
    positions = [RowSampling(SamplingParams(seed=5), 5, p) for p in range(8)]
    assert len(set(np.asarray(_sample(logits, sampling_inputs(positions, 8)).token_ids).tolist())) > 1


def test_greedy_rows_take_the_argmax_and_banned_ids_are_never_drawn():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 32)), jnp.float32)
    greedy = np.asarray(_sample(logits, greedy_inputs(4)).token_ids)
    assert greedy.tolist() == np.argmax(np.asarray(logits), -1).tolist()
    banned = tuple(int(t) for t in greedy[:1])
    rows = [RowSampling(SamplingParams(temperature=0.0), 0, 0, banned), None, None, None]
    masked = np.asarray(_sample(logits, sampling_inputs(rows, 4)).token_ids)
    assert masked[0] != greedy[0] and masked[1:].tolist() == greedy[1:].tolist()
    hot = [RowSampling(SamplingParams(temperature=5.0), s, 0, banned) for s in range(4)]
    many = jnp.tile(logits[:1], (4, 1))
    assert banned[0] not in np.asarray(_sample(many, sampling_inputs(hot, 4)).token_ids).tolist()


def test_logprobs_are_the_raw_distributions_top_tokens_and_the_chosen_ones():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 40)), jnp.float32)
    rows = [RowSampling(SamplingParams(temperature=1.0, top_k=2, logprobs=1 if s else None), s, 0) for s in range(3)]
    out = _sample(logits, sampling_inputs(rows, 3))  # one row asks: every row gets them
    raw = np.asarray(jax.nn.log_softmax(logits, -1))
    assert np.asarray(out.top_ids).tolist() == np.argsort(-raw, -1)[:, :20].tolist()
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.sort(raw, -1)[:, ::-1][:, :20], rtol=1e-6)
    chosen = raw[np.arange(3), np.asarray(out.token_ids)]
    np.testing.assert_allclose(np.asarray(out.logprob), chosen, rtol=1e-6)
    assert all(t in ids[:2] for t, ids in zip(np.asarray(out.token_ids), np.asarray(out.top_ids), strict=True))


def test_an_all_greedy_step_sorts_nothing_and_a_mixed_step_keeps_its_greedy_rows_exact():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 48)), jnp.float32)
    step = jax.make_jaxpr(sample)(logits, greedy_inputs(4)).jaxpr
    (branch,) = [eqn for eqn in step.eqns if eqn.primitive.name == "cond"]
    assert not any(" sort[" in str(eqn) for eqn in step.eqns if eqn is not branch)
    sorts = [" sort[" in str(b) for b in branch.params["branches"]]
    assert sorted(sorts) == [False, True]  # the vocabulary sort runs only in the drawing branch
    rows = [
        RowSampling(SamplingParams(temperature=2.0), 9, 0),
        RowSampling(SamplingParams(temperature=0.0), 0, 0),
        None,
        None,
    ]
    mixed = np.asarray(_sample(logits, sampling_inputs(rows, 4)).token_ids)
    assert mixed[1:].tolist() == np.argmax(np.asarray(logits), -1)[1:].tolist()


def test_a_step_where_no_row_asks_for_logprobs_computes_and_returns_none():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(4, 48)), jnp.float32)
    rows = [RowSampling(SamplingParams(temperature=1.0), 1, 0), None]
    plain = sampling_inputs(rows, 4)
    assert not plain.logprobs
    out = _sample(logits, plain)
    assert out.logprob is None and out.top_ids is None and out.top_logprobs is None
    assert "top_k" not in str(jax.make_jaxpr(sample)(logits, plain))
    asked = sampling_inputs([RowSampling(SamplingParams(temperature=1.0, logprobs=3), 1, 0), None], 4)
    assert asked.logprobs and "top_k" in str(jax.make_jaxpr(sample)(logits, asked))
    np.testing.assert_array_equal(_sample(logits, asked).token_ids, out.token_ids)  # the same draw


def test_inputs_travel_as_one_int32_array_and_read_back_exactly():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)
    inputs = sampling_inputs([RowSampling(params, 2**32 - 1, 11, (3, 4))], 2)
    assert jax.tree.leaves(inputs)[0].dtype == np.int32 and len(jax.tree.leaves(inputs)) == 1
    assert inputs.temperature.tolist() == np.float32([0.7, 0.0]).tolist() and inputs.top_k.tolist() == [5, 0]
    assert inputs.top_p.tolist() == np.float32([0.9, 1.0]).tolist() and inputs.min_p[0] == np.float32(0.05)
    assert inputs.seed.tolist() == [2**32 - 1, 0] and inputs.position.tolist() == [11, 0]
    assert inputs.num_banned.tolist() == [2, 0] and inputs.banned[0, :3].tolist() == [3, 4, 0]
    on_device = jax.jit(lambda x: (x.temperature, x.seed))(inputs)
    assert np.asarray(on_device[0]).tolist() == inputs.temperature.tolist()
    assert np.asarray(on_device[1]).tolist() == inputs.seed.tolist()


# ------------------------------------------------------------------ penalties and logit bias
def vllm_penalised(logits, prompt, outputs, params):
    """vLLM 0.33's formula in NumPy (``LogitBiasLogitsProcessor``, then ``apply_penalties`` with
    ``apply_repetition_penalties_torch``): one row's logits bent by ``params``."""
    out = np.array(logits, np.float32)
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    counts = np.bincount(np.asarray(outputs, int), minlength=out.shape[-1]).astype(np.float32)
    seen = counts > 0
    seen[np.asarray(prompt, int)] = True
    penalty = np.where(seen, params.repetition_penalty, 1.0).astype(np.float32)
    out *= np.where(out > 0, 1.0 / penalty, penalty)
    out -= params.frequency_penalty * counts
    return out - params.presence_penalty * (counts > 0)


def _request(prompt, outputs):
    request = Request("r", list(prompt))
    if outputs:
        request.append_output_token_ids(list(outputs))
    return request


def test_penalised_rows_follow_vllms_formula_and_other_rows_keep_their_logits():
    rng = np.random.default_rng(7)
    vocab = 64
    logits = rng.normal(size=(4, vocab)).astype(np.float32) * 3
    prompt, outputs = rng.integers(vocab, size=30).tolist(), rng.integers(vocab, size=12).tolist()
    everything = SamplingParams(
        temperature=0.0,
        presence_penalty=0.7,
        frequency_penalty=-0.4,
        repetition_penalty=1.6,
        logit_bias={int(outputs[-1]): 5.0, 3: -100.0},
    )
    repeat_only = SamplingParams(temperature=0.0, repetition_penalty=0.6)
    rows = [
        # decoding: the step feeds the last output (position - 1), the host sends those before it
        RowSampling(everything, 0, len(prompt) + len(outputs), (), _request(prompt, outputs)),
        RowSampling(SamplingParams(temperature=0.0), 0, 5),
        # the first draw: the step feeds the last prompt token, there are no outputs yet
        RowSampling(repeat_only, 0, len(prompt), (), _request(prompt, ())),
        None,
    ]
    fed = jnp.asarray([outputs[-1], 0, prompt[-1], 0], jnp.int32)
    inputs = sampling_inputs(rows, 4)
    bent = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), inputs.penalties, fed))
    np.testing.assert_allclose(bent[0], vllm_penalised(logits[0], prompt, outputs, everything), rtol=1e-6)
    np.testing.assert_allclose(bent[2], vllm_penalised(logits[2], prompt, (), repeat_only), rtol=1e-6)
    np.testing.assert_array_equal(bent[[1, 3]], logits[[1, 3]])  # bit for bit
    tokens = np.asarray(_sample(jnp.asarray(logits), inputs, fed).token_ids)
    assert tokens.tolist() == np.argmax(bent, -1).tolist()  # greedy rows take the bent argmax
    assert tokens[1] == np.argmax(logits[1])


@pytest.mark.oracle
def test_repetition_penalty_and_logit_bias_bend_logits_as_transformers_processors_do():
    """Against transformers' own logits processors (an implementation we did not write):
    its sequence bias of single tokens, then its repetition penalty over prompt and outputs
    (the order vLLM applies them in)."""
    torch = pytest.importorskip("torch")
    processors = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(11)
    vocab = 64
    logits = rng.normal(size=(2, vocab)).astype(np.float32) * 3
    prompt, outputs = rng.integers(vocab, size=30).tolist(), rng.integers(vocab, size=12).tolist()
    bias = {int(outputs[-1]): 5.0, 3: -7.5}
    params = SamplingParams(temperature=0.0, repetition_penalty=1.6, logit_bias=bias)
    rows = [RowSampling(params, 0, len(prompt) + len(outputs), (), _request(prompt, outputs)), None]
    fed = jnp.asarray([outputs[-1], 0], jnp.int32)
    bent = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), sampling_inputs(rows, 2).penalties, fed))
    ids = torch.tensor([prompt + outputs])
    biased = processors.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(ids, torch.tensor(logits[:1]))
    theirs = processors.RepetitionPenaltyLogitsProcessor(1.6)(ids, biased)  # vLLM's order: bias, then repetition
    np.testing.assert_allclose(bent[0], theirs.numpy()[0], rtol=1e-6)
    np.testing.assert_array_equal(bent[1], logits[1])


def test_a_host_one_token_late_sends_the_same_history_and_so_does_an_unpacked_prompt():
    prompt, outputs = [5, 6, 7], [8, 9, 10]
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2)
    position = len(prompt) + len(outputs)  # the step feeds outputs[-1]
    knows_all = sampling_inputs([RowSampling(params, 0, position, (), _request(prompt, outputs))], 2)
    one_late = sampling_inputs([RowSampling(params, 0, position, (), _request(prompt, outputs[:-1]))], 2)
    unpacked = SimpleNamespace(num_prompt_tokens=3, all_token_ids=prompt + outputs, prompt_bytes=b"")
    read_by_id = sampling_inputs([RowSampling(params, 0, position, (), unpacked)], 2)
    assert _request(prompt, ()).prompt_bytes  # a Request's prompt is read from its packed bytes
    for other in (one_late, read_by_id):
        for a, b in zip(jax.tree.leaves(knows_all.penalties), jax.tree.leaves(other.penalties), strict=True):
            np.testing.assert_array_equal(a, b)
    assert knows_all.penalties.counts[0].tolist() == [3, 5, 1]  # prompt 3 + outputs 8, 9; the fed one is an output


def test_penalty_values_compile_nothing_and_a_step_without_them_carries_none():
    logits = jnp.asarray(np.random.default_rng(8).normal(size=(4, 48)), jnp.float32)
    fed = jnp.zeros(4, jnp.int32)
    traces = []

    @jax.jit
    def step(lg, inputs, fed_ids):
        traces.append(inputs.penalties is not None)
        return sample(lg, inputs, fed_ids)

    assert sampling_inputs([RowSampling(SamplingParams(temperature=0.0), 0, 3)], 4).penalties is None
    step(logits, greedy_inputs(4), fed)
    history = _request([1, 2, 3], [4])
    for value in (0.5, 1.5, -2.0):
        params = SamplingParams(temperature=1.0, presence_penalty=value, logit_bias={7: value})
        step(logits, sampling_inputs([RowSampling(params, 1, 4, (), history), None], 4), fed)
    assert traces == [False, True]  # greedy, and one penalised variant for every value
    with pytest.raises(PenaltyInputsError, match="history"):
        sampling_inputs([RowSampling(SamplingParams(frequency_penalty=1.0), 1, 4)], 4)


@pytest.mark.slow
def test_the_engine_draws_penalised_greedy_tokens_as_a_dense_forward_with_vllms_formula():
    """A greedy request that repeats one token over and over stops repeating under a
    frequency penalty, each token the argmax of the dense model's logits bent by vLLM's
    formula; the unpenalised request beside it in the batch is unchanged."""
    engine = Engine.build(
        "tiny-llama",
        memory_bytes=4 << 20,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        buckets=Buckets((64,), (4,), (16,)),
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, 12).tolist() for _ in range(5)]
    prompt = prompts[-1]  # greedy decoding repeats token 337 from its third token on
    params = SamplingParams(
        temperature=0.0, max_tokens=12, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={208: 3.0}
    )
    plain = engine.generate([prompt], 12).outputs[0].output_token_ids
    repeated = int(np.argmax(np.bincount(plain)))
    assert plain.count(repeated) > 6
    both = engine.generate([prompt, prompts[0]], [params, 12]).outputs
    assert both[1].output_token_ids == engine.generate([prompts[0]], 12).outputs[0].output_token_ids
    dense = jax.jit(engine.model.dense)
    tokens = list(prompt)
    for _ in range(12):
        padded = np.zeros((1, 64), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = np.asarray(dense(engine.model.params, jnp.asarray(padded)))[0, len(tokens) - 1]
        tokens.append(int(np.argmax(vllm_penalised(logits, prompt, tokens[len(prompt) :], params))))
    assert list(both[0].output_token_ids) == tokens[len(prompt) :]
    assert both[0].output_token_ids.count(repeated) == 1

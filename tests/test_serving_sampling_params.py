"""SamplingParams: vLLM's names and defaults, every bad value refused by name."""

import pytest

from jaxkv.serving.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError


def test_defaults_are_vllms_and_greedy_is_temperature_zero():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.stop, params.ignore_eos) == (16, 0, (), False)
    assert SamplingParams.greedy(5) == SamplingParams(temperature=0.0, max_tokens=5)
    assert SamplingParams.greedy(5).is_greedy and not params.is_greedy


def test_the_bounds_themselves_are_accepted():
    params = SamplingParams(n=128, top_k=2**31 - 1, stop=["s" * 1024] * 32, stop_token_ids=list(range(1024)))
    assert (params.n, params.top_k, len(params.stop), len(params.stop_token_ids)) == (128, 2**31 - 1, 32, 1024)


def test_one_stop_string_is_a_list_of_one_and_top_k_minus_one_keeps_every_token():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n must be a positive int, got 0"),
        ({"temperature": -0.1}, r"temperature must be in \[0.0, 100.0\], got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a number, got nan"),
        ({"temperature": "1"}, "temperature must be a number, got '1'"),
        ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, "top_k must be a non-negative int, got -2"),
        ({"min_p": 2}, "min_p must be in"),
        ({"seed": -1}, "seed must be a non-negative int, got -1"),
        ({"seed": 2**32 - 1, "n": 2}, "seed \\+ n must fit in 32 bits"),
        ({"max_tokens": 0}, "max_tokens must be a positive int, got 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens=5 exceeds max_tokens=4"),
        ({"stop": [""]}, "stop must be a non-empty string or a list of them"),
        ({"stop": 3}, "stop must be"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of ints >= 0"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"logprobs": MAX_LOGPROBS + 1}, f"logprobs must be at most {MAX_LOGPROBS}"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, f"prompt_logprobs must be at most {MAX_LOGPROBS}"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs=-1 \(the whole vocabulary\) is not supported"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be"),
        ({"n": True}, "n must be a positive int, got True"),
        # bounds that keep one client's request from costing the others (issue 41)
        ({"n": 200_000}, "n must be at most 128, got 200000"),
        ({"top_k": 2**31}, "top_k must be at most 2147483647"),
        ({"stop": ["x"] * 90_000}, "stop may list at most 32 strings, got 90000"),
        ({"stop": ["ab" * 600]}, "stop strings may have at most 1024 characters, got one of 1200"),
        ({"stop_token_ids": list(range(5000))}, "stop_token_ids may list at most 1024 ids, got 5000"),
        # penalties and logit bias: vLLM's ranges
        ({"presence_penalty": 2.01}, r"presence_penalty must be in \[-2.0, 2.0\], got 2.01"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2.0, 2.0\], got -3"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number, got nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0, got inf"),
        ({"repetition_penalty": True}, "repetition_penalty must be a finite number > 0, got True"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias must be a map of token ids to numbers"),
        ({"logit_bias": {"-1": 2.0}}, "logit_bias keys must be token ids >= 0, got '-1'"),
        ({"logit_bias": {"1.5": 2.0}}, "logit_bias keys must be token ids >= 0, got '1.5'"),
        ({"logit_bias": {1: None}}, "logit_bias values must be numbers, got None for 1"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias values must be numbers, got nan for 1"),
        ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "logit_bias may list at most 1024 tokens, got 1025"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_penalties_default_to_neutral_and_logit_bias_reads_json_keys_clamped_as_vllm():
    params = SamplingParams()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias is None and not params.has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties and SamplingParams(presence_penalty=-2).has_penalties
    biased = SamplingParams(logit_bias={"7": 250, 3: -0.5, "9": float("-inf")})
    assert dict(biased.logit_bias) == {7: 100.0, 3: -0.5, 9: -100.0} and not biased.has_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(TypeError):
        biased.logit_bias[7] = 1.0  # read-only

"""A request's token ids: checked on the way in (bulk or one by one), read-only after."""

import numpy as np
import pytest

from jaxkv.core.hashing import BlockHasher, ExtraKeys
from jaxkv.core.manager_errors import KVCacheManagerError
from jaxkv.core.prompt_digests import PromptDigests
from jaxkv.core.request import Request, token_id_list


def test_bad_requests_are_named():
    with pytest.raises(KVCacheManagerError, match="empty prompt"):
        Request("x", [])
    with pytest.raises(KVCacheManagerError, match="request_id"):
        Request(7, [1])


@pytest.mark.parametrize(
    "prompt",
    [None, [[1, 2]], [True, 2], "abc", (t for t in [1, 2]), np.zeros((2, 3), np.int32)],
    ids=["None", "nested", "bool", "str", "generator", "2-D"],
)
def test_prompts_that_are_not_token_ids_get_a_typed_error(prompt):
    with pytest.raises(KVCacheManagerError, match="'x': prompt_token_ids"):
        Request("x", prompt)


def test_numpy_prompts_become_plain_ints():
    req = Request("x", np.arange(5, dtype=np.int64))
    assert req.all_token_ids == [0, 1, 2, 3, 4] and all(type(t) is int for t in req.all_token_ids)


@pytest.mark.parametrize(
    "bad",
    [2**31, 2**32, -1, True, False, 7.0, "7", None, [7]],
    ids=["2**31", "2**32", "-1", "True", "False", "7.0", "'7'", "None", "[7]"],
)
def test_long_prompts_take_the_bulk_check_and_still_refuse_every_bad_id(bad):
    prompt = list(range(100, 2700))
    assert Request("ok", prompt).all_token_ids == prompt
    prompt[1234] = bad
    with pytest.raises(KVCacheManagerError, match="token id"):
        Request("x", prompt)


@pytest.mark.parametrize("low", [0, 1])
def test_a_prompt_with_ids_0_and_1_is_checked_in_bulk_and_a_bool_beside_them_is_refused(low):
    prompt = [1, *range(100, 2700), low]  # a BOS of 1, as Llama 2's
    assert Request("ok", prompt).prompt_bytes == np.asarray(prompt, "<i4").tobytes()
    prompt[500] = bool(low)
    with pytest.raises(KVCacheManagerError, match=f"{bool(low)} is not a token id"):
        Request("x", prompt)


def test_numpy_ints_inside_a_list_become_plain_ints():
    req = Request("x", [np.int64(5), 6, np.int32(7)])
    assert req.all_token_ids == [5, 6, 7] and all(type(t) is int for t in req.all_token_ids)


def test_a_one_token_list_is_appended_like_an_int():
    req = Request("x", [5, 6])
    req.append_output_token_ids([7])
    with pytest.raises(KVCacheManagerError):
        req.append_output_token_ids([2**31])
    assert req.all_token_ids == [5, 6, 7]


def test_a_short_list_is_checked_like_a_long_one():
    ids = [3, 4]
    out = token_id_list(ids, "step tokens")
    assert out == ids and out is not ids
    assert token_id_list([np.int64(5), 6], "step tokens") == [5, 6]
    assert all(type(t) is int for t in token_id_list([np.int64(5), 6], "step tokens"))
    for bad in ([3, True], [3, -1], [3, 2**31], [3, 1.0]):
        with pytest.raises(KVCacheManagerError, match="step tokens"):
            token_id_list(bad, "step tokens")


def test_the_error_names_what_was_checked_and_the_first_bad_id():
    with pytest.raises(KVCacheManagerError, match=r"^output tokens: token id -3 is outside"):
        token_id_list([4, -3, -5], "output tokens")


def test_the_token_view_reads_like_a_list_but_cannot_be_edited_or_hashed():
    req = Request("x", [5, 6, 7])
    view = req.all_token_ids
    assert view == [5, 6, 7] and view == (5, 6, 7) and view[1:] == [6, 7]
    req.append_output_token_ids(8)
    assert view[-1] == 8 and req.output_token_ids == [8] and req.prompt_token_ids == (5, 6, 7)
    with pytest.raises(TypeError):
        view[0] = 1
    with pytest.raises(TypeError, match="unhashable"):
        hash(view)


def test_a_prompt_hashes_the_same_whichever_way_its_ids_were_checked():
    prompt = list(range(100, 2700))
    bulk, from_numpy, one_by_one = Request("a", prompt), Request("b", np.array(prompt)), Request("c", range(100, 2700))
    assert bulk.prompt_bytes == from_numpy.prompt_bytes == np.asarray(prompt, "<i4").tobytes()
    assert one_by_one.prompt_bytes == b""
    hasher = BlockHasher(16)
    for req in (bulk, from_numpy, one_by_one):
        req.append_output_token_ids(list(range(30)))
        req.extend_block_hashes(hasher, PromptDigests(hasher.block_bytes))
    expected: list[bytes] = []
    hasher.extend(expected, prompt + list(range(30)))
    assert bulk.block_hashes == from_numpy.block_hashes == one_by_one.block_hashes == expected
    assert len(expected) == 164


def test_the_prompt_stays_a_tuple_as_outputs_arrive():
    req = Request("x", (5, 6, 7), cache_salt="s")
    req.append_output_token_ids([8, 9])
    assert req.prompt_token_ids == (5, 6, 7) and req.extra_keys.cache_salt == "s"
    assert Request("y", [5]).extra_keys == ExtraKeys()

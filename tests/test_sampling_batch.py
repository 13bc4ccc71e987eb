"""The sampling inputs kept across steps: reused while the rows hold the same, rebuilt when not,
and, once the step sets the positions, the inputs a fresh build gives (what the sampler draws from)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.request import Request
from jaxkv.serving.sampler import RowSampling, SamplingBatch, at_positions, sampling_inputs
from jaxkv.serving.sampling_params import SamplingParams

SEEDED = SamplingParams(temperature=0.8, top_k=5, seed=3)
GREEDY = SamplingParams(temperature=0.0)


def _batch() -> tuple[SamplingBatch, list[np.ndarray]]:
    """A batch placing its rows on the default device, and the host rows it was asked to place."""
    placed: list[np.ndarray] = []

    def place(values: np.ndarray) -> jax.Array:
        placed.append(values)
        return jax.device_put(values)

    return SamplingBatch(place), placed


def _rows(position: int, banned: tuple[int, ...] = ()) -> list[RowSampling | None]:
    return [RowSampling(SEEDED, 11, position, banned), None, RowSampling(GREEDY, 0, position + 4)]


def test_a_steady_batch_is_sent_once_and_its_positions_come_from_the_step():
    batch, placed = _batch()
    first = batch.inputs(_rows(10), 4)
    assert isinstance(first.packed, jax.Array) and len(placed) == 1
    assert batch.inputs(_rows(11), 4) is first and batch.inputs(_rows(12), 4) is first  # positions: not compared
    assert len(placed) == 1

    for position in (11, 12):  # the step's positions in: the inputs a fresh build has (what sample draws from)
        fresh = sampling_inputs(_rows(position), 4)
        positions = jnp.asarray([position, 7, position + 4, 0])  # the draws' positions, as the step has them
        step = at_positions(first, positions)
        assert np.asarray(step.position).tolist() == [position, 7, position + 4, 0]
        fresh_seeded = np.asarray(fresh.packed)[0]
        np.testing.assert_array_equal(np.asarray(step.packed)[0], fresh_seeded)  # the seeded row: all of it


def test_a_row_that_changes_rebuilds_the_batch_exactly():
    batch, placed = _batch()
    batch.inputs(_rows(10), 4)
    changes = [
        (_rows(10, banned=(2,)), 4),  # banned ids (min_tokens)
        ([RowSampling(SEEDED, 12, 10), None, RowSampling(GREEDY, 0, 14)], 4),  # a seed
        ([RowSampling(SEEDED, 12, 10), RowSampling(GREEDY, 0, 3), RowSampling(GREEDY, 0, 14)], 4),  # a row joins
        ([RowSampling(SEEDED, 12, 10), RowSampling(GREEDY, 0, 3), RowSampling(GREEDY, 0, 14)], 8),  # padding
    ]
    for k, (rows, num_rows) in enumerate(changes, start=2):
        inputs = batch.inputs(rows, num_rows)
        assert len(placed) == k
        np.testing.assert_array_equal(np.asarray(inputs.packed), sampling_inputs(rows, num_rows).packed)


def test_rows_with_penalties_are_rebuilt_every_step_and_not_kept():
    request = Request("r", [1, 2, 3])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    batch, placed = _batch()
    for step in range(3):
        inputs = batch.inputs([RowSampling(params, 0, 3 + step, (), request)], 2)
        assert inputs.penalties is not None
        request.append_output_token_ids([5])
    assert len(placed) == 3
    plain = batch.inputs([RowSampling(GREEDY, 0, 3)], 2)
    assert plain.penalties is None and batch.inputs([RowSampling(GREEDY, 0, 4)], 2) is plain

"""What a serving engine needs of a model: :class:`ServedModel`.

A model is a guest of the engine. It declares the layers that hold cache (names and
:class:`~jaxkv.specs.KVCacheSpec`), its weights as a pytree, where the weights split
over a tensor-parallel mesh, and one forward step over a ragged batch against the paged
cache. The engine plans the cache from the specs, owns the cache and the weights on
device, builds each step's :class:`~jaxkv.device.metadata.StepMetadata` and jits
:meth:`ServedModel.forward` once per shape, the model object a static argument.

Inside ``forward`` an attention layer calls :func:`jaxkv.device.ops.write_kv` and
:func:`jaxkv.device.ops.paged_attention` with its own name: the cache supplies its window and
the metadata its block table. A recurrent layer reads and writes its state with
:func:`jaxkv.device.state_cache.read_layer_state` / :func:`~jaxkv.device.state_cache.write_layer_state`
over the cache and ``meta.states_of(layer)`` (a :class:`~jaxkv.device.metadata.StateMetadata`),
whichever place the plan gave the states (state rows or KV pages).

Optional (a :class:`DenseModel`): ``dense(params, tokens (B, L)) -> logits (B, L, vocab)``, a forward
without a cache that scripts use as an oracle when a model has it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import StepMetadata
from jaxkv.device.state_cache import HybridCache
from jaxkv.specs import KVCacheSpec


@runtime_checkable
class ServedModel(Protocol):
    """What an :class:`~jaxkv.serving.engine.Engine` needs of a model."""

    @property
    def name(self) -> str:
        """For printing ("tiny-hybrid", "LlamaForCausalLM ...")."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``; logits have this last dim."""
        ...

    @property
    def params(self) -> Any:
        """Pytree of ``jax.Array`` weights: the only traced input of :meth:`forward` besides
        the cache and the metadata."""
        ...

    def __hash__(self) -> int:
        """Compiled steps are cached per model (identity, unless the model defines equality)."""
        ...

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """Every layer that holds cache, in model order: an attention spec
        (:class:`~jaxkv.specs.FullAttentionSpec`, :class:`~jaxkv.specs.SlidingWindowSpec`...)
        or a :class:`~jaxkv.specs.MambaSpec` for a recurrent layer.
        ``plan_kv_cache(model.layer_specs(), ...)`` plans the cache this model reads."""
        ...

    def partition_specs(self) -> Any:
        """A pytree like :attr:`params` of :class:`jax.sharding.PartitionSpec`, with
        :data:`jaxkv.device.mesh.MODEL_AXIS` on the split dimension (column-parallel q/k/v,
        gate/up; row-parallel o, down); ``PartitionSpec()`` = replicated."""
        ...

    def forward(
        self, params: Any, cache: KVCache | HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, KVCache | HybridCache]:
        """One step over a ragged batch (decodes first, then prefill chunks): float32
        logits ``(S, vocab)`` at ``meta.logits_indices`` and the updated cache (a
        :class:`~jaxkv.device.state_cache.HybridCache` when the model has recurrent layers).
        Pure: weights come only from ``params``; ``impl`` goes to :mod:`jaxkv.device.ops`."""
        ...


class DenseModel(ServedModel, Protocol):
    """A :class:`ServedModel` with the optional dense forward, the oracle of scripts and tests."""

    def dense(self, params: Any, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` over ``params``, without a cache."""
        ...

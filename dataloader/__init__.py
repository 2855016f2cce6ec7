"""Length-aware dataloading: sources that know lengths before tokens, global batches by token
budget, background planning on rank 0, per-rank dispatch of exactly its shards, exact resume.

``open_source(path)`` opens jsonl / parquet / Megatron ``.bin``/``.idx`` / ``synthetic:NAME``;
:class:`BatchStream` forms global batches; :class:`HDPDataLoader` plans and dispatches them.
"""

from .batching import BatchStream, GlobalBatch, SeqRef
from .loader import IGNORE_INDEX, HDPDataLoader, StepData, WaveData
from .sources import (
    DataError,
    JsonlSource,
    MegatronSource,
    ParquetSource,
    SyntheticSource,
    open_source,
)
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "BatchStream",
    "ByteTokenizer",
    "DataError",
    "GlobalBatch",
    "HDPDataLoader",
    "JsonlSource",
    "MegatronSource",
    "ParquetSource",
    "SeqRef",
    "StepData",
    "SyntheticSource",
    "WaveData",
    "load_tokenizer",
    "open_source",
]

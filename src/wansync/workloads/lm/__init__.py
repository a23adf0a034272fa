"""LLaMA-style language-model workload: model sizes, tokenizers, corpora, sharded data."""

from wansync.workloads.lm.corpus import load_corpus, shakespeare_plays, shakespeare_text, strip_markdown
from wansync.workloads.lm.model import LM_MODELS, LMShape, TransformerLM, check_seq_len, lm_shape
from wansync.workloads.lm.tokenizer import BPETokenizer, ByteTokenizer, build_tokenizer
from wansync.workloads.lm.workload import LMWorkload, build_lm_workload

__all__ = [
    "LM_MODELS",
    "LMShape",
    "TransformerLM",
    "check_seq_len",
    "lm_shape",
    "ByteTokenizer",
    "BPETokenizer",
    "build_tokenizer",
    "load_corpus",
    "shakespeare_plays",
    "shakespeare_text",
    "strip_markdown",
    "LMWorkload",
    "build_lm_workload",
]

"""Constrained decoding: what a request asks its output to match (GrammarSpec), compiled once per
spec and tokenizer (Grammars), followed token by token by one Matcher per sequence, whose
allowed-token bitmask the sampler applies to the logits (engine/sampler.py).

The grammar library (xgrammar; docs/benchmark.md says why not llguidance) is imported only
here, behind these three names, so that another one could replace it.
"""

from radixserve.grammar.compiled import Grammars
from radixserve.grammar.matcher import GrammarFault, MaskBuffer, Matcher, TokenMask
from radixserve.grammar.spec import GrammarError, GrammarSpec

__all__ = ["GrammarError", "GrammarFault", "GrammarSpec", "Grammars", "MaskBuffer", "Matcher", "TokenMask"]

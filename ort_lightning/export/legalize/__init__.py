"""Legalization: nodes ORT 1.19.2's gradient builder cannot take, rewritten into exact equivalents.

``engine`` holds the rule table and applies it, ``graph`` is what a rewrite works with, and
``rewrites/`` holds the rules, one family per module.
"""

from ort_lightning.export.legalize.engine import RULES, Rule, legalize

__all__ = ["RULES", "Rule", "legalize"]

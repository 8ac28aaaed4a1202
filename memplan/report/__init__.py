"""Output: rich tables, the JSON / Markdown / CSV formats, explain's derivations and the plots. The only layer that
imports rich (and matplotlib, lazily)."""

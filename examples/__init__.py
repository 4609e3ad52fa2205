"""Example documents (public-domain texts and PDFs made from them), installed with specache as the
package `specache_examples` so that `specache bench` finds its default documents in an installed copy
as well as in a checkout (engine/bench/common.py EXAMPLES)."""

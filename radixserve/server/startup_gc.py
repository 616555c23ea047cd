"""The objects a server starts with, kept out of the cyclic garbage collector's way.

Loading a model leaves a few hundred thousand Python objects (torch, transformers, the
tokenizer, the model's modules) that live as long as the process. CPython's full collection
walks every tracked object: about a quarter of a second each here, and it runs now and then
in the middle of serving (twice during the first requests after start-up, in one
measurement), stalling every stream at once. Frozen (`gc.freeze`), those objects are skipped
by every later collection; plain reference counting still frees them. A cycle that was
garbage when frozen would never be collected, so whatever is garbage is collected first.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collects the garbage there is, then freezes every object still tracked; returns how
    many objects are frozen in all. Call once the server has loaded everything it keeps."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

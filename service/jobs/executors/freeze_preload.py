"""Imported last by the job forkserver (``PRELOAD`` in ``process.py``): what the preload built is
kept out of the garbage collector from here on.

A job process is forked from the forkserver and inherits its heap, several hundred thousand
objects of torch and transformers. Unfrozen, the first full collection in a job walks them all
(0.3 s) and, by writing to their headers, copies their memory pages into the job process. Frozen
objects are never walked: a job's collections cost what the job itself allocated. This is the use
``gc.freeze`` documents (freeze in the parent, then fork); only the forkserver imports this module.
"""

import gc

gc.collect()
gc.freeze()

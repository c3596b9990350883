"""The one module the job forkserver imports (``set_forkserver_preload`` in ``process.py``):
it imports what a job will import (:func:`.preload.preload`, derived from the code), then keeps
what that built out of the garbage collector from here on.

A job process is forked from the forkserver and inherits its heap, several hundred thousand
objects of torch and transformers. Unfrozen, the first full collection in a job walks them all
(0.3 s) and, by writing to their headers, copies their memory pages into the job process. Frozen
objects are never walked: a job's collections cost what the job itself allocated. This is the use
``gc.freeze`` documents (freeze in the parent, then fork); only the forkserver imports this module.
"""

import gc

from service.jobs.executors.preload import preload

preload()
gc.collect()
gc.freeze()

"""What `p2pdiloco local`'s fork server imports before it forks a peer (app/prefork.py): what a peer of the default
config has imported by its first inner step, less what only some configs use (bitsandbytes, aiohttp, HF
tokenizers, plots). The server imports this module, then `p2pdiloco.cli` (named in `prefork.PRELOAD`: the
command line sits above every layer, so no module of `app/` imports it).

No thread is started by these imports but numpy's OpenBLAS pool (scipy's is never loaded: its optimize
module is deferred), which stops and restarts itself across a fork (pthread_atfork), as it already does when a
peer forks its DHT process; no accelerator is initialized. tests/test_prefork.py checks both, and that nothing a headless peer avoids is imported.
"""

from p2pdiloco.app.startup import defer_unused_imports

defer_unused_imports()  # before hivemind, as a peer's own start does

import multiprocessing.popen_fork  # noqa: E402, F401  (the DHT process's start)

import hivemind.utils.multiaddr.codecs.cid  # noqa: E402, F401  (read when a peer parses its first multiaddr)
import hivemind.utils.multiaddr.codecs.ip4  # noqa: E402, F401
import hivemind.utils.multiaddr.codecs.uint16be  # noqa: E402, F401

import p2pdiloco.algorithm.codecs  # noqa: E402, F401
import p2pdiloco.app.peer  # noqa: E402, F401

import os
import sys

from pretrain.resilience.standby.client import forward

if __name__ == "__main__":
    os.umask(0o077)  # every file a rank (and its writers) makes is private: checkpoints are the model
    # Under a launcher with a standby server beside it, the rank is forked there (already imported).
    code = forward("pretrain")
    if code is None:
        # Deferred: torch and Megatron take seconds to import, and a forwarded rank never needs them here.
        from pretrain.cli import run

        code = run()
    sys.exit(code)

"""``python -m pretrain.checkpointing.agent``: run the node's checkpoint agent (started by a rank)."""

import sys

from pretrain.checkpointing.agent.server import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m pretrain.checkpointing.agent``: run the node's checkpoint agent (started by a rank)."""

import sys

from pretrain.checkpointing.agent.server import main

sys.exit(main())

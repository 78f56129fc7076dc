"""What a checkpoint contains and how each tier saves and restores it.

* :mod:`.state`: the training state and the parts every format shares;
* :mod:`.reshardable`: Megatron distributed checkpoints (reshardable across TP/PP/DP);
* :mod:`.per_rank`: fast per-rank local saves, replicated to peers (tiers 1-2);
* :mod:`.tiered`: when each tier saves, and the recovery order local -> peer -> reshardable.
"""

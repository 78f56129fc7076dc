"""Standby rank processes: a rank starts as a fork of a process that has already imported torch,
Megatron and this package, instead of importing them again (seconds of CPU per rank, at every
restart).

* :mod:`.beside` starts the standby server next to a launcher (``ft_launcher``, ``torchrun``) and
  puts its address in the environment the launcher passes to its workers.
* :mod:`.client` is what ``python -m pretrain`` does when it finds that address: it hands its
  argv, environment, working directory and standard streams to the server, and then stands for
  the rank towards the launcher (signals forwarded to the rank, the rank's exit status mirrored,
  the rank killed if the client dies).
* :mod:`.server` preloads and forks; :mod:`.rank_entry` is what a fork runs.
* :mod:`.wire` is the framing between the two.

Any failure to reach the server makes the client run the rank itself, as before.
"""

"""What differs between the machines and library versions the rank program runs on: API moves
between megatron-core versions (:mod:`.compat`), the versions recorded in every checkpoint
(:mod:`.versions`), the no-op CUDA shims a CUDA-less host needs (:mod:`.cpu_shims`) and which GPU a
rank uses (:mod:`.rank_device`, when present), and Linux's process table (:mod:`.procfs`)."""

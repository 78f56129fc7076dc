"""The CLI verbs besides ``train``: demo, drill, plan, status, launch (Slurm/Kubernetes) and the
run summary they print."""

"""The ``tiering`` command (``python -m tiering``, the ``tiering`` console script).

``main`` parses the flags and runs one subcommand; ``listing`` holds the read-only views
(``ls``, ``verify``) and ``object_store`` the commands on tier 3 (``upload``, ``restore``, ``gc``),
whose functions ``pretrain upload`` and ``pretrain gc`` also call. Every setting is a flag: the
package reads no training config; never imports ``pretrain``.
"""

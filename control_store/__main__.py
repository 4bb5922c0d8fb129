"""``python -m control_store``: the ``control-store`` command (see ``control_store.cli``)."""

from control_store._launch import main

# Guarded: multiprocessing's spawn start method re-imports the main module in each child.
if __name__ == "__main__":
    raise SystemExit(main())

"""Import every public module of a sub-package, so that dropping a file into ``models/``, ``tasks/``,
``criterions/`` or ``modules/`` is all it takes to register it (fairseq auto-imports only ``models/`` and
``tasks/`` of a ``--user-dir``; criteria would otherwise stay unregistered)."""

import importlib
import os


def import_submodules(package_name, package_file):
    package_dir = os.path.dirname(package_file)
    for entry in sorted(os.listdir(package_dir)):
        path = os.path.join(package_dir, entry)
        if entry.startswith(("_", ".")):
            continue
        if entry.endswith(".py"):
            importlib.import_module(f"{package_name}.{entry[:-3]}")
        elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "__init__.py")):
            importlib.import_module(f"{package_name}.{entry}")

from fairseq_ext._imports import import_submodules

import_submodules(__name__, __file__)

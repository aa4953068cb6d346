"""msllm: a MindSpore-native toolkit for training and fine-tuning LLaMA-family models.

The package is layered so that each module imports only from modules below it in the data flow
(see README.md, "Architecture"): ``errors``/``fileio`` -> ``config`` -> ``data``, ``models`` ->
``parallel``, ``cluster`` -> ``training``.
"""

__version__ = "0.1.0"

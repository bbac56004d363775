"""A stand-in for torchvision in the peers' environment (never in the project's).

Mosaic Streaming imports ``torchvision.datasets.VisionDataset`` and
``torchvision.transforms.functional.to_tensor`` when ``streaming`` is imported (for its
image datasets, which this benchmark does not use). The torchvision wheel that pip
resolves for torch 2.13 is built for another torch variant and fails to import next to
the CPU build ("operator torchvision::nms does not exist"), so install.sh removes it and
puts this folder on the path instead. Anything else from it raises ImportError.
"""

__version__ = "0.0.0+peers-stub"

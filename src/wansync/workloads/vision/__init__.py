"""Vision workloads: small CNN, ResNet-18/50 (CIFAR stem), ViT-S; Fashion-MNIST, CIFAR, image folders."""

from .augment import random_crop_flip
from .datasets import DATASET_FORMS, load_dataset
from .imagedata import ImageData
from .models import VISION_MODELS, build_model
from .workload import VisionWorkload, build_vision_workload

__all__ = [
    "VISION_MODELS",
    "DATASET_FORMS",
    "ImageData",
    "VisionWorkload",
    "build_model",
    "build_vision_workload",
    "load_dataset",
    "random_crop_flip",
]

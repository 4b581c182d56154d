"""The data pipeline: corpora -> chat data with loss masks -> target-regenerated responses -> target
features (offline store, or the same capture online).

    from dflash_train.data import load_prepared
    from dflash_train.data.features import FeatureStore, compute_features
"""

from dflash_train.data.prepared import load_prepared

__all__ = ["load_prepared"]

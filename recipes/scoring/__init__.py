"""Scoring the recipe runs (the speedrun's summary, goals, curve, ablation table and minutes per stage): scripts over a run
directory's reports, outside the library. Run from the repository root, as the recipe scripts do:

    python -m recipes.scoring.summary OUT --goal mt-bench=4.0
    python -m recipes.scoring.curve OUT
    python -m recipes.scoring.compare OUT/train/ablation-*
    python -m recipes.scoring.stages OUT OTHER_OUT

They read `dflash_train`'s outputs (eval reports, trainer states, metrics); nothing in `dflash_train` imports
them.
"""

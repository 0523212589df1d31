"""Run folders as frameworks write them (Trainer, accelerate, Lightning, torchtitan): detection and reading."""

"""Data files bundled with the package: the fine-tune demo's answer cards (make_answer_cards.py)."""

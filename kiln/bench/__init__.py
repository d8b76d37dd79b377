"""`kiln bench`: measure Kiln against reference engines on the same weights and write a report."""

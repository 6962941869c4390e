"""`gemctl profile`: where the step time goes and what it costs in MFU."""

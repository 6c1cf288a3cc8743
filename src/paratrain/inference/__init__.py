"""A trained run loaded back: its network (`trained.load_model`), and the predictor that prepares inputs as
training did (`predictor`)."""

"""Reading finished runs back and judging them: the report (tables, plots, report.md), the verdict
sentences and the statistics behind them."""

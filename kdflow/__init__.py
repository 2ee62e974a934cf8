"""kdflow: offline knowledge distillation with cached teacher top-K, orchestrated by Prefect."""

"""MetaSchedule tuning and its databases; imports neither kernels nor passes."""

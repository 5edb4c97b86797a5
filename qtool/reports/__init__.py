"""Records -> what people and CI read: JSON documents, tables, Markdown/JUnit, plots, terminal safety."""

"""Reading a run's files and answering from them: where its time went, why its slow steps
were slow. No server and no tracker SDK: the files alone; cli/ prints the answers."""

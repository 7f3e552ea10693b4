() => { document.getElementById(__ID_LESSONS_RUN__)?.click(); }

() => { document.querySelector('#' + __ID_LESSONS_PRESENT__ + ' input')?.click(); }

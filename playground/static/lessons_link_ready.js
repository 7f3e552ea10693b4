() => { document.documentElement.classList.remove('dp-lesson-pending'); }
